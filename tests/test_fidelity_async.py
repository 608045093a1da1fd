"""Async scheduling (plan N+1 built before step N's result) keeps greedy output identical to HF."""

from __future__ import annotations

import random
from pathlib import Path

from tests.harness import OfflineEngine, make_runner
from tests.models import assert_teacher_forced, load_hf

BLOCK = 16


def batch(engine: OfflineEngine, seed: int, eos: frozenset[int] = frozenset()) -> list:  # type: ignore[type-arg]
    rng = random.Random(seed)
    shapes = ((5, 20), (17, 9), (40, 30), (3, 1), (33, 14))
    return [engine.add([rng.randrange(3, 49152) for _ in range(p)], m, eos=eos)[0] for p, m in shapes]


def test_async_scheduling_matches_hf_under_chunking_and_preemption(tiny_qwen2_dir: Path) -> None:
    runner = make_runner(tiny_qwen2_dir, 7, BLOCK)
    engine = OfflineEngine(runner, 7, plans_in_flight=2, max_num_batched_tokens=24, preemption_mode="recompute")
    reqs = batch(engine, 5)
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    hf = load_hf(tiny_qwen2_dir)
    for req in reqs:
        assert len(req.output_token_ids) == req.stop.max_tokens
        assert_teacher_forced(hf, req.prompt_token_ids, req.output_token_ids)
    assert engine.scheduler.blocks.num_free == 7


def test_async_drops_the_token_sampled_after_a_stop(tiny_qwen2_dir: Path) -> None:
    sync = OfflineEngine(make_runner(tiny_qwen2_dir, 40, BLOCK), 40)
    reference = batch(sync, 6)
    sync.run()
    eos_token = reference[2].output_token_ids[3]  # request 2 must stop at its 4th token
    engine = OfflineEngine(make_runner(tiny_qwen2_dir, 40, BLOCK), 40, plans_in_flight=2)
    reqs = batch(engine, 6, eos=frozenset({eos_token}))
    engine.run()
    for ref, req in zip(reference, reqs):
        out = ref.output_token_ids
        cut = out.index(eos_token) + 1 if eos_token in out else len(out)
        assert req.output_token_ids == out[:cut]
    assert engine.scheduler.blocks.num_free == 40
