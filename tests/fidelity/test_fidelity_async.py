"""Async scheduling (plan N+1 built before step N's result) keeps greedy output identical to HF, and overlaps."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.engine import EngineRun, Submitted, load_runner
from tests.support.models import assert_teacher_forced, load_hf

pytestmark = pytest.mark.model

BLOCK = 16


def batch(run: EngineRun, seed: int, ignore_eos: bool = True) -> list[Submitted]:
    rng = random.Random(seed)
    shapes = ((5, 20), (17, 9), (40, 30), (3, 1), (33, 14))
    return [run.add([rng.randrange(3, 49152) for _ in range(p)], m, ignore_eos=ignore_eos) for p, m in shapes]


def test_async_scheduling_matches_hf_under_chunking_and_preemption(tiny_qwen2_dir: Path) -> None:
    runner = load_runner(tiny_qwen2_dir, 7, BLOCK)
    with EngineRun(runner, tokenizer_dir=tiny_qwen2_dir, max_num_batched_tokens=24, preemption_mode="recompute") as run:
        reqs = batch(run, 5)
        run.run()
        assert run.scheduler.num_preemptions > 0
        assert run.scheduler.blocks.num_free == 7
    hf = load_hf(tiny_qwen2_dir)
    for req in reqs:
        assert len(req.output) == req.max_tokens
        assert_teacher_forced(hf, req.prompt, req.output)


def test_async_drops_the_token_sampled_after_a_stop(tiny_qwen2_dir: Path) -> None:
    with EngineRun(
        load_runner(tiny_qwen2_dir, 40, BLOCK), tokenizer_dir=tiny_qwen2_dir, async_scheduling=False
    ) as sync:
        reference = batch(sync, 6)
        sync.run()
    eos_token = reference[2].output[3]  # request 2 must stop at its 4th token
    with EngineRun(load_runner(tiny_qwen2_dir, 40, BLOCK), tokenizer_dir=tiny_qwen2_dir) as run:
        run.engine.tokenizer.eos_token_ids = frozenset({eos_token})
        reqs = batch(run, 6, ignore_eos=False)
        run.run()
        assert run.scheduler.blocks.num_free == 40
    for ref, req in zip(reference, reqs):
        out = ref.output
        cut = out.index(eos_token) + 1 if eos_token in out else len(out)
        assert req.output == out[:cut]


def test_async_scheduling_keeps_two_plans_in_flight(tiny_llama_dir: Path) -> None:
    """With async scheduling the engine sends plan N+1 before step N's result is back; without it, one at a time.
    An engine that stopped overlapping would fail the first assertion."""
    for async_scheduling, expected in ((True, 2), (False, 1)):
        runner = load_runner(tiny_llama_dir, 40, BLOCK)
        with EngineRun(runner, tokenizer_dir=tiny_llama_dir, async_scheduling=async_scheduling) as run:
            batch(run, 7)
            run.run()
            assert run.workers.most_in_flight == expected, f"async_scheduling={async_scheduling}"
