"""Live migration with KV import (issue 31, item 1): a source engine whose workers serve KV keeps each migrated
sequence's computed blocks, its partial last block included, under a lease named in the state; the target pulls
them and computes only each sequence's last token. Greedy, seeded, n > 1 and shared-prefix outputs in bfloat16 are
those of an undisturbed run of the same batch; the source frees the blocks once released (the router's Abort) and
a pull that fails (the source gone) recomputes instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from proto.wire import SamplingOptions
from scheduler_node.core.request import FinishReason, RequestSpec
from tests.scheduler_node.engine.test_migration import Seq
from tests.support.engine import EngineRun, load_runner
from tests.support.ops import prompt_ids
from worker_node.kv.handoff import make_handoff
from worker_node.model_runner import ModelRunner

pytestmark = pytest.mark.model

BLOCK = 16
BLOCKS = 48
SHARED = prompt_ids(5, 20)
CASES = [  # (prompt, sampling, n, stop strings)
    (SHARED + prompt_ids(1, 5), SamplingOptions(temperature=0.0), 1, []),
    (SHARED + prompt_ids(2, 9), SamplingOptions(temperature=0.9, seed=11), 1, ["zq~"]),
    (prompt_ids(3, 13), SamplingOptions(temperature=0.8, top_k=50, seed=4), 3, []),
    (SHARED + prompt_ids(4, 3), SamplingOptions(temperature=0.0), 2, []),
]
MAX_TOKENS = 20
MOVE_AT = 7  # outputs every sequence has when the source migrates them


def spec(i: int, migratable: bool = False) -> RequestSpec:
    prompt, sampling, n, stop = CASES[i]
    return RequestSpec(f"m{i}", prompt, sampling, MAX_TOKENS, stop, True, n, 50, migratable=migratable)


def runner(folder: Path, serve: bool) -> ModelRunner:
    r = load_runner(folder, BLOCKS, BLOCK, dtype="bfloat16")
    r.handoff = make_handoff(r.kv_cache, r.comm.where, serve=serve)
    return r


@pytest.fixture
def engines(tiny_llama_dir: Path) -> Iterator[tuple[EngineRun, EngineRun, EngineRun]]:
    """An undisturbed engine, a source that serves KV and a target; fresh caches each."""
    runners = [runner(tiny_llama_dir, True) for _ in range(3)]
    with (
        EngineRun(runners[0], tokenizer_dir=tiny_llama_dir) as ref,
        EngineRun(runners[1], tokenizer_dir=tiny_llama_dir) as source,
        EngineRun(runners[2], tokenizer_dir=tiny_llama_dir) as target,
    ):
        yield ref, source, target
    for r in runners:
        assert r.handoff is not None
        r.handoff.close()


def run_batch(run: EngineRun, migratable: bool) -> list[list[Seq]]:
    """Every case at once; with `migratable`, the engine migrates them all after the step that gave each
    sequence MOVE_AT tokens. Each sequence's deltas, as its client got them."""
    engine = run.engine
    out = [[Seq() for _ in range(c[2])] for c in CASES]

    def after_step() -> None:
        live = engine.scheduler.requests.values()
        if len(live) == sum(c[2] for c in CASES) and all(len(r.output_token_ids) >= MOVE_AT for r in live):
            engine.after_step = None
            assert engine.migrate() == len(CASES)

    async def scenario() -> None:
        streams = [engine.submit(spec(i, migratable)) for i in range(len(CASES))]
        for stream, seqs in zip(streams, out):
            async for delta in stream:
                seqs[delta.index].take(delta)

    if migratable:
        engine.after_step = after_step
    run.serve(scenario)
    return out


def resume_all(run: EngineRun, moved: list[list[Seq]]) -> None:
    """Each migrated request continued on `run` from its states, its deltas added to the same sequences."""

    async def scenario() -> None:
        for i, seqs in enumerate(moved):
            states = tuple(s.migrated for s in seqs if s.migrated is not None)
            assert len(states) == CASES[i][2] and all(s.finish_reason is FinishReason.MIGRATED for s in seqs)
            for s in seqs:
                s.finish_reason = None
            resumed = dataclasses.replace(spec(i), resume=states)
            async for delta in run.engine.submit(resumed):
                seqs[delta.index].take(delta)

    run.serve(scenario)


def test_migrated_sequences_pull_their_kv_and_match_an_undisturbed_run_in_bf16(engines) -> None:  # type: ignore[no-untyped-def]
    ref, source, target = engines
    want = run_batch(ref, migratable=False)
    moved = run_batch(source, migratable=True)
    states = [s.migrated for seqs in moved for s in seqs]
    assert all(s is not None and s.kv_source is not None for s in states), "the source serves KV: every state names it"
    for s in states:
        assert s is not None and s.kv_source is not None
        assert s.kv_source.tokens == s.prompt_tokens + len(s.output_token_ids) - 1
    leased = sum(len(s.kv_source.blocks) for s in states if s and s.kv_source)
    assert source.scheduler.leases.num_blocks == leased, "the blocks wait under the leases for the target"

    resume_all(target, moved)
    for case, w, g in zip(CASES, want, moved):
        for ws, gs in zip(w, g):
            assert gs.token_ids == ws.token_ids, case
            assert gs.text == ws.text, case
            assert (gs.finish_reason, gs.completion_tokens) == (ws.finish_reason, ws.completion_tokens), case
    # Every position but each sequence's last token was pulled: the target computed one token per step.
    left = sum(MAX_TOKENS - len(s.output_token_ids) for s in states if s is not None)
    assert target.scheduler.counters.scheduled_tokens == left
    assert 0 < target.scheduler.leases.imported_blocks <= leased, "the rest were in its prefix cache already"
    counted = target.scheduler.counters
    assert (counted.migrations_imported, counted.migrations_recomputed) == (len(states), 0)
    pulled = counted.migration_kv_tokens_imported
    assert 0 < pulled <= sum(s.kv_source.tokens for s in states if s and s.kv_source), pulled

    for i in range(len(CASES)):  # the router's Abort once the target answered
        assert source.engine.release_kv(f"m{i}")
    exporter = source.workers.runners[0].handoff.exporter  # type: ignore[union-attr]
    leases = source.scheduler.leases
    source.run_until(lambda: not leases.num_blocks and not leases.pending and not exporter.num_leases, "released")
    assert source.scheduler.blocks.num_free == BLOCKS


def test_a_pull_that_fails_recomputes(engines) -> None:  # type: ignore[no-untyped-def]
    """The source's exporter is gone before the target pulls: the target recomputes prompt + outputs and the
    streams still end complete (bf16 recompute may part from an undisturbed run, so lengths are checked)."""
    _, source, target = engines
    moved = run_batch(source, migratable=True)
    source.workers.runners[0].handoff.exporter.close()  # type: ignore[union-attr]
    target.workers.runners[0].handoff.timeout_s = 0.5  # type: ignore[union-attr]
    resume_all(target, moved)
    for seqs in moved:
        assert all((s.finish_reason, len(s.token_ids)) == (FinishReason.LENGTH, MAX_TOKENS) for s in seqs)
    counted = target.scheduler.counters
    assert counted.preemptions_recompute >= 1
    assert counted.migrations_recomputed >= 1, "a failed pull counts as a recompute"
    assert counted.migrations_imported + counted.migrations_recomputed == sum(c[2] for c in CASES)
    source.workers.runners[0].handoff.exporter = None  # type: ignore[union-attr]  # closed above
