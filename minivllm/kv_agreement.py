"""Teacher-forced top-1 agreement of a quantized KV cache with full precision, for
tests/minivllm/test_kv_agreement.py and
scripts/bench_kv_quant.py.

The model runs over an int8 / fp8 cache through the offline API (prefills chunked, so later chunks and every
decode step read what earlier steps quantized); each greedy token is then scored by HF transformers in float32 on
the same prefix. A token agrees when it is HF's best within the float32 fidelity tolerance (1e-3 in logprob: what
a full-precision cache is held to); the worst gap is the largest logprob by which a chosen token fell short of
HF's best. The mean logprob error, |our logprob - HF's| of each chosen token, sees the cache's error at every
position, also where the top-1 token did not change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams

FLOAT32_TOL = 1e-3
BLOCK = 16
CHUNK = 16  # max_num_batched_tokens: prompts longer than this are prefilled in chunks


@dataclass(frozen=True, slots=True)
class Agreement:
    tokens: int  # generated tokens scored
    agreeing: int
    worst_gap: float  # logprob
    mean_logprob_error: float

    @property
    def rate(self) -> float:
        return self.agreeing / self.tokens

    def __add__(self, other: Agreement) -> Agreement:
        tokens = self.tokens + other.tokens
        error = (self.mean_logprob_error * self.tokens + other.mean_logprob_error * other.tokens) / tokens
        return Agreement(tokens, self.agreeing + other.agreeing, max(self.worst_gap, other.worst_gap), error)


def quantized_agreement(
    folder: Path,
    kv_cache_dtype: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    backend: str = "auto",
    dtype: str = "float32",
) -> Agreement:
    """Greedy outputs of `prompts` over a `kv_cache_dtype` cache (the model in `dtype`, attention by `backend`),
    scored against HF's float32 model."""
    num_blocks = sum(-(-(len(p) + m) // BLOCK) for p, m in zip(prompts, max_tokens)) + 2
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in max_tokens]
    with LLM(
        str(folder), dtype=dtype, kv_cache_dtype=kv_cache_dtype, attention_backend=backend, block_size=BLOCK,
        num_kv_blocks=num_blocks, max_num_batched_tokens=CHUNK, max_model_len=num_blocks * BLOCK, swap_space=0,
    ) as llm:  # fmt: skip
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
    hf = _hf_model(folder)
    gaps, errors = [], []
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        reference = _hf_logprobs(hf, prompt, completion.token_ids)
        chosen = reference.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        gaps.append(reference.max(-1).values - chosen)
        ours = torch.tensor([lp.logprob for lp in completion.logprobs or []])
        errors.append((ours - chosen).abs())
    gap, error = torch.cat(gaps), torch.cat(errors)
    return Agreement(len(gap), int((gap <= FLOAT32_TOL).sum()), float(gap.max()), float(error.mean()))


@torch.inference_mode()
def _hf_logprobs(hf_model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's float32 log-probabilities `[len(output), vocab]` of each generated position, given the same prefix."""
    logits = hf_model(torch.tensor([prompt + output])).logits
    return logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)


@functools.cache
def _hf_model(folder: Path) -> Any:
    """HF's float32 model of `folder`, loaded once for every cache format scored against it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
