"""The HF reference check: teacher-forced greedy tokens and logprobs (the tiny models: minivllm/tiny_models.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's logits; a bf16/fp16 model's last hidden states are scored in float32, as our LM head scores its
    top candidates: logits rounded to bf16 move in steps of 1/16 at 8-16, coarser than the bf16 tolerance."""
    if hf_model.dtype == torch.float32:
        return hf_model(ids).logits
    hidden = hf_model.model(ids).last_hidden_state
    head = hf_model.get_output_embeddings()
    bias = None if head.bias is None else head.bias.float()
    return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)


@torch.inference_mode()
def hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's float32 log-probabilities `[len(output), vocab]` of each generated position, given the same prefix."""
    return _hf_logits(hf_model, torch.tensor([prompt + output]))[0, len(prompt) - 1 : -1].float().log_softmax(-1)


def teacher_forced_gaps(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Per generated token: HF's best logprob minus the token's own, given the same prefix (0: HF's greedy choice)."""
    logp = hf_logprobs(hf_model, prompt, output)
    return logp.max(-1).values - logp.gather(1, torch.tensor(output)[:, None])[:, 0]


def assert_teacher_forced(hf_model, prompt: list[int], output: list[int], tol: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
    """Every generated token must be HF's greedy choice given the same prefix (within tol in logprob)."""
    gaps = teacher_forced_gaps(hf_model, prompt, output)
    bad = (gaps > tol).nonzero().flatten().tolist()
    assert not bad, f"token {bad[0]} ({output[bad[0]]}) is {float(gaps[bad[0]]):.2e} below HF's best"


@torch.inference_mode()
def assert_same_logprobs(hf_model, runner, tokens: list[int], tol: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
    """Our log-probabilities over the whole vocabulary at every position of `tokens` (one prefill through a
    TP 1 runner's model and cache) are HF's within `tol`: this sees what greedy tokens cannot, such as a
    monotonic soft-cap on the logits."""
    from worker_node.models.attention import AttentionMetadata

    n, int32 = len(tokens), torch.int32
    table = torch.arange(-(-n // runner.block_size), dtype=int32)[None]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode_tokens=0,
        decode_block_tables=table[:0],
        decode_seq_lens=torch.zeros(0, dtype=int32),
        prefill_block_tables=table,
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=int32),
        prefill_seq_lens=torch.tensor([n], dtype=int32),
    )
    hidden = runner.model(torch.tensor(tokens), torch.arange(n), runner.kv_cache, meta)
    ours = runner.model.logits(hidden).log_softmax(-1)
    theirs = hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    gap = float((ours - theirs).abs().max())
    assert gap < tol, f"log-probabilities differ from HF's by up to {gap:.2e}"
