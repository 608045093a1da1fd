"""Greedy fidelity to HF with the memory manager at work: prefix hits, n=3 forks, swap and elastic preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kernels.kv_quant import as_bytes
from proto.wire import StepPlan
from tests.support.engine import EngineRun, load_runner
from tests.support.models import assert_teacher_forced, load_hf

pytestmark = pytest.mark.model

BLOCK = 16


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    return load_hf(tiny_llama_dir)


def test_prefix_hits_keep_fidelity(tiny_llama_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1)
    system = tokens(rng, 40)  # 2.5 blocks shared
    runner = load_runner(tiny_llama_dir, 40, BLOCK)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=64) as run:
        first = run.add(system + tokens(rng, 5), 6)
        run.run()
        wave = [run.add(system + tokens(rng, n), 8) for n in (1, 9, 30)]
        run.run()
        c = run.scheduler.counters
        assert c.prefix_cache_hits == 3 * 32, "the two full system-prompt blocks must be hits for the second wave"
    for req in [first, *wave]:
        assert_teacher_forced(hf, req.prompt, req.output)


def test_n3_forks_share_blocks_and_keep_fidelity(tiny_llama_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(2)
    runner = load_runner(tiny_llama_dir, 30, BLOCK)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=64) as run:
        groups = [run.add(tokens(rng, n), 10, n=3) for n in (21, 32)]  # a partial and a full last prompt block
        run.run()
        assert sum(len(p.block_copies) for p in run.plans) >= 4, "copy-on-write of the shared last blocks"
        assert run.scheduler.blocks.num_free == 30
    for group in groups:
        outs = {tuple(c.token_ids) for c in group.completions}
        assert len(outs) == 1, "greedy siblings must agree"
        for c in group.completions:
            assert_teacher_forced(hf, group.prompt, c.token_ids)


@pytest.mark.parametrize("mode", ["swap", "elastic"])
def test_swap_and_elastic_preemption_keep_fidelity(tiny_llama_dir: Path, hf, mode: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    num_blocks = 10  # the batch needs ~16 at its peak
    runner = load_runner(tiny_llama_dir, num_blocks, BLOCK, num_host_blocks=32)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=32, preemption_mode=mode) as run:
        reqs = [run.add(tokens(rng, n), m) for n, m in ((20, 30), (33, 25), (7, 40), (50, 12))]
        run.run()
        assert run.scheduler.counters.preemptions_swap > 0, "the test lost its point: nothing was swapped"
        assert run.scheduler.blocks.num_host_used == 0
    for req in reqs:
        assert len(req.output) == req.max_tokens
        assert_teacher_forced(hf, req.prompt, req.output)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_swapped_back_kv_is_bit_identical(tiny_llama_dir: Path, kv_cache_dtype: str) -> None:
    """Swap moves every tensor of a block: keys and values, and a quantized cache's scales."""
    runner = load_runner(tiny_llama_dir, 8, BLOCK, num_host_blocks=4, kv_cache_dtype=kv_cache_dtype)
    tensors = [as_bytes(t) for layer in runner.kv_cache for t in layer.tensors()]
    assert len(tensors) == (2 if kv_cache_dtype == "auto" else 4) * len(runner.kv_cache)
    for t in tensors:
        t.copy_(torch.randint(1, 127, t.shape))  # non-zero bytes of every dtype (0x7f would be a float8 NaN)
    before = [t[[2, 5]].clone() for t in tensors]
    runner.run_block_ops(StepPlan(1, swap_out=[(2, 0), (5, 3)]))
    for t in tensors:  # the device blocks get reused by someone else meanwhile
        t[[2, 5]] = 0
    runner.run_block_ops(StepPlan(2, swap_in=[(0, 6), (3, 1)]))
    for t, t0 in zip(tensors, before):
        assert torch.equal(t[[6, 1]], t0)
