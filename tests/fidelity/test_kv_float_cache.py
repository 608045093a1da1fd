"""A full-precision KV cache in another float than the model's (the article's `kv_cache: fp16` under `embedding:
bf16`): --kv-cache-dtype float16 with a bfloat16 model, through the torch and native backends, scored against HF's
float32 model on the same prefix (minivllm/kv_agreement.py) beside the bfloat16 cache it replaces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kernels.kv_quant import cache_dtype
from minivllm.kv_agreement import quantized_agreement
from worker_node.kv.cache import bytes_per_block
from worker_node.models.config import ModelConfig

pytestmark = pytest.mark.model

LENGTHS, MAX_TOKENS = [5, 17, 40], [12, 12, 16]  # prompts cross 16-token blocks and 16-token prefill chunks
BF16_TOL = 0.05  # the fidelity rule for a bf16 model: logprobs within 0.05 of HF's float32


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_fp16_cache_under_bf16_model_is_as_close_to_hf_as_a_bf16_cache(tiny_llama_dir: Path, backend: str) -> None:
    bf16 = quantized_agreement(tiny_llama_dir, "auto", _prompts(), MAX_TOKENS, backend, dtype="bfloat16")
    fp16 = quantized_agreement(tiny_llama_dir, "float16", _prompts(), MAX_TOKENS, backend, dtype="bfloat16")
    summary = f"bf16 cache {bf16}, fp16 cache {fp16}"
    assert fp16.mean_logprob_error < BF16_TOL, summary
    assert fp16.worst_gap < BF16_TOL, summary  # each greedy token is HF's best within the bf16 tolerance
    assert fp16.mean_logprob_error < bf16.mean_logprob_error + 0.01, summary  # fp16 keeps 3 more mantissa bits


def test_an_fp16_cache_takes_half_the_bytes_of_a_float32_model(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_folder(tiny_llama_dir)
    kv = cache_dtype("float16", torch.float32)
    assert kv == torch.float16
    assert bytes_per_block(config, 16, kv) * 2 == bytes_per_block(config, 16, cache_dtype("auto", torch.float32))
