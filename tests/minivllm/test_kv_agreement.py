"""A quantized KV cache (--kv-cache-dtype int8 | fp8_e4m3) end to end: its greedy tokens against HF's float32
model on the same prefix (minivllm/kv_agreement.py), on the tiny model of every architecture and on SmolLM2; the
capacity it buys; the doors that set it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels.kv_quant import FORMATS, SCALE_DTYPE
from minivllm.kv_agreement import Agreement, quantized_agreement
from minivllm.llm import LLM
from minivllm.tiny_models import TINY_VARIANTS
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.engine import load_runner
from worker_node.kv.cache import bytes_per_block
from worker_node.models.config import ModelConfig

pytestmark = pytest.mark.model

LENGTHS, MAX_TOKENS = [5, 17, 40], [24, 12, 30]  # prompts cross 16-token blocks and 16-token prefill chunks
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,"]
# Measured by scripts/bench_kv_quant.py (docs/benchmarks.md): on these tiny random models, whose top two tokens are
# often
# within 0.05 in logprob, int8 agrees about as often as a bfloat16 model does, fp8 (3 mantissa bits) less often;
# on SmolLM2 both agree above 97 %.
FLOORS = {"int8": 0.95, "fp8_e4m3": 0.82}


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_greedy_tokens_agree_with_full_precision(
    kv_cache_dtype: str,
    tiny_llama_dir: Path,
    tiny_qwen2_dir: Path,
    tiny_mistral_dir: Path,
    tiny_model_dir: Callable[[str], Path],
    smollm2_dir: Path,
) -> None:
    folders = [tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir] + [tiny_model_dir(n) for n in TINY_VARIANTS]
    tiny = [quantized_agreement(f, kv_cache_dtype, _tiny_prompts(), MAX_TOKENS) for f in folders]
    texts = [ModelTokenizer(smollm2_dir).encode(t) for t in TEXTS]
    smollm2 = quantized_agreement(smollm2_dir, kv_cache_dtype, texts, [24] * len(texts))
    everything = sum(tiny[1:], tiny[0]) + smollm2
    summary = f"tiny models {[f'{a.rate:.2f}' for a in tiny]}, SmolLM2 {smollm2.rate:.3f}"
    assert smollm2.rate >= 0.97, summary
    assert everything.rate >= FLOORS[kv_cache_dtype], summary
    assert everything.mean_logprob_error < 0.1, summary


def test_int8_is_closer_to_full_precision_than_fp8(tiny_model_dir: Callable[[str], Path]) -> None:
    """int8 keeps 8 bits under its scale, e4m3 3 mantissa bits: the logprobs of the chosen tokens say so, and a
    float32 cache's stay at float32 rounding."""
    folder = tiny_model_dir("mistral-window")  # a window shorter than the outputs: windows read quantized KV too
    runs = {f: quantized_agreement(folder, f, _tiny_prompts(), MAX_TOKENS) for f in ("auto", "int8", "fp8_e4m3")}
    assert runs["auto"].rate == 1.0 and runs["auto"].mean_logprob_error < 1e-4
    assert runs["int8"].mean_logprob_error < runs["fp8_e4m3"].mean_logprob_error / 2


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_holds_scales_beside_its_values(tiny_llama_dir: Path, kv_cache_dtype: str) -> None:
    runner = load_runner(tiny_llama_dir, 8, 16, kv_cache_dtype=kv_cache_dtype)
    layer = runner.kv_cache[0]
    assert layer.k.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]
    assert layer.k_scales is not None and layer.v_scales is not None
    assert layer.k_scales.shape == layer.k.shape[:3] and layer.k_scales.dtype == SCALE_DTYPE
    config = ModelConfig.from_folder(tiny_llama_dir)
    block = sum(t[0].nbytes for layer in runner.kv_cache for t in layer.tensors())
    assert block == bytes_per_block(config, 16, layer.k.dtype)
    # head_dim 16: 16 one-byte values and a 4-byte scale per token and head, against 64 bytes in float32
    assert bytes_per_block(config, 16, torch.float32) / block == pytest.approx(64 / 20)


def test_agreement_adds_up() -> None:
    total = Agreement(10, 9, 0.5, 0.01) + Agreement(30, 30, 0.0, 0.05)
    assert (total.tokens, total.agreeing, total.worst_gap) == (40, 39, 0.5)
    assert total.rate == pytest.approx(39 / 40) and total.mean_logprob_error == pytest.approx(0.04)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_auto_sizing_counts_the_smaller_blocks(tiny_llama_dir: Path, kv_cache_dtype: str) -> None:
    """The same memory budget holds as many more blocks as each is smaller, and the memory stats say so in bytes."""
    budget = 2**20
    device = {}
    for fmt in ("auto", kv_cache_dtype):
        with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=budget, kv_cache_dtype=fmt) as llm:
            device[fmt] = next(p for p in llm.engine.kv_pools() if p.tier == "device")
    full, compact = device["auto"], device[kv_cache_dtype]
    assert (full.format, compact.format) == ("float32", kv_cache_dtype)
    config = ModelConfig.from_folder(tiny_llama_dir)
    assert compact.bytes_per_block == bytes_per_block(config, 16, FORMATS[kv_cache_dtype])
    for pool in (full, compact):
        assert budget - pool.bytes_per_block < pool.allocated_bytes <= budget  # the budget, filled
    assert compact.total_blocks == budget // compact.bytes_per_block
    assert compact.total_blocks / full.total_blocks == pytest.approx(64 / 20, rel=0.05)
