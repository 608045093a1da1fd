"""Disaggregated prefill → decode in process: a prefill engine computes each prompt and holds its blocks under a
lease, a decode engine pulls them over the KV transfer socket and generates. Greedy tokens are identical to one
colocated engine's, in float32, bf16 and int8 KV, between PP 2 worlds and between TP 2 worlds or worlds of TP 1 and
TP 2 (each consumer rank pulls its KV heads from the producer rank(s) holding them); a producer gone mid-hand-off
or a lease released before the pull makes the decode side compute the prompt itself; no block stays leased at
idle. Both engines sit on one host, so the pulls go through staging buffers (worker_node/kv/transfer/staging.py), as by
default; one case moves them by frames over TCP (`--kv-transfer-mode tcp`)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support.engine import EngineRun, load_runner
from tests.support.inprocess_tp import TensorParallelRanks
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.stages import stage_runners
from worker_node.kv.handoff import make_handoff
from worker_node.model_runner import ModelRunner

pytestmark = pytest.mark.model

BLOCK = 16
BLOCKS = 24


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (47, 64, 90)]


def runner(folder: Path, dtype: str, kv: str) -> ModelRunner:
    return load_runner(folder, BLOCKS, BLOCK, dtype=dtype, kv_cache_dtype=kv)


@pytest.fixture
def pair(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[EngineRun, EngineRun]]:
    dtype, kv, *mode = getattr(request, "param", ("float32", "auto"))
    same_host = mode != ["tcp"]
    producer, consumer = runner(tiny_llama_dir, dtype, kv), runner(tiny_llama_dir, dtype, kv)
    producer.handoff = make_handoff(producer.kv_cache, producer.comm.where, serve=True, same_host=same_host)
    consumer.handoff = make_handoff(consumer.kv_cache, consumer.comm.where, serve=False, same_host=same_host)
    with EngineRun(producer, tokenizer_dir=tiny_llama_dir) as p, EngineRun(consumer, tokenizer_dir=tiny_llama_dir) as d:
        yield p, d
    for r in (producer, consumer):
        assert r.handoff is not None
        r.handoff.close()


def colocated(folder: Path, dtype: str, kv: str, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
    with EngineRun(runner(folder, dtype, kv), tokenizer_dir=folder) as run:
        done = [run.add(p, max_tokens) for p in ps]
        run.run()
    return [s.output for s in done]


def hand_off(p: EngineRun, d: EngineRun, prompt: list[int], max_tokens: int, release: bool = True) -> list[int]:
    """Prefill on `p` (one token, its blocks leased), decode on `d` from the lease; the lease released after."""
    first = p.add(prompt, 1, kv_produce=True)
    p.run()
    source = p.engine.kv_source(first.request_id)
    assert source is not None, "the prefill holds its prompt blocks under a lease"
    decoded = d.add(prompt, max_tokens, kv_source=source)
    d.run()
    if release:
        assert p.engine.release_kv(first.request_id)
    return decoded.output


def nothing_leased(p: EngineRun, ranks: Sequence[ModelRunner] = ()) -> None:
    """The prefill's scheduler holds no block under a lease and its workers (`ranks`, default its first) serve no
    lease (they learn of a release with the next plan, which the engine sends for it)."""
    exporters = [r.handoff.exporter for r in ranks or p.workers.runners[:1] if r.handoff is not None]
    assert all(e is not None for e in exporters) and exporters
    leases = p.scheduler.leases

    def none_left() -> bool:
        return not leases.num_blocks and not leases.pending and not any(e and e.num_leases for e in exporters)

    p.run_until(none_left, "no lease left")


def pulls(ranks: Sequence[ModelRunner]) -> tuple[int, int]:
    """Pulls the producer ranks answered with a staging buffer, and by frames."""
    exporters = [r.handoff.exporter for r in ranks if r.handoff is not None and r.handoff.exporter is not None]
    return sum(e.pulls_staged for e in exporters), sum(e.pulls_framed for e in exporters)


def close_handoffs(ranks: Sequence[ModelRunner]) -> None:
    for r in ranks:
        if r.handoff is not None:
            r.handoff.close()


@pytest.mark.parametrize(
    "pair",
    [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("bfloat16", "auto", "tcp")],
    indirect=True,
    ids=["fp32", "bf16", "int8", "bf16-tcp"],
)
def test_handoff_is_token_identical_to_colocated(pair, tiny_llama_dir: Path, request) -> None:  # type: ignore[no-untyped-def]
    p, d = pair
    dtype, kv, *mode = request.node.callspec.params["pair"]
    ps = prompts(1)
    expected = colocated(tiny_llama_dir, dtype, kv, ps, 12)
    outputs = [hand_off(p, d, prompt, 12) for prompt in ps]
    assert outputs == expected
    assert d.scheduler.leases.imported_blocks == sum((len(x) - 1) // BLOCK for x in ps), "every full block pulled"
    assert d.scheduler.counters.prefix_cache_hits == d.scheduler.leases.imported_blocks * BLOCK
    assert pulls(p.workers.runners) == ((0, len(ps)) if mode == ["tcp"] else (len(ps), 0)), "one host: staged"
    nothing_leased(p)


def test_a_producer_gone_mid_handoff_means_recompute(pair, tiny_llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    p, d = pair
    prompt = prompts(2)[1]
    expected = colocated(tiny_llama_dir, "float32", "auto", [prompt], 8)[0]
    first = p.add(prompt, 1, kv_produce=True)
    p.run()
    source = p.engine.kv_source(first.request_id)
    assert source is not None
    p.workers.runners[0].handoff.exporter.close()  # type: ignore[union-attr]  # the prefill world is gone
    d.workers.runners[0].handoff.timeout_s = 0.5  # type: ignore[union-attr]
    decoded = d.add(prompt, 8, kv_source=source)
    d.run()
    assert decoded.output == expected, "computed on the decode side instead"
    assert d.scheduler.counters.preemptions_recompute >= 1
    p.workers.runners[0].handoff.exporter = None  # type: ignore[union-attr]  # closed above


def test_cancel_or_timeout_frees_the_lease(pair, tiny_llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    p, d = pair
    ps = prompts(3)
    cancelled = p.add(ps[0], 1, kv_produce=True)
    p.run()
    assert p.scheduler.leases.num_blocks == (len(ps[0]) - 1) // BLOCK
    source = p.engine.kv_source(cancelled.request_id)
    assert p.engine.abort(cancelled.request_id), "an abort of a finished prefill frees its lease"
    nothing_leased(p)
    decoded = d.add(ps[0], 6, kv_source=source)  # too late: the lease is gone, the decode side computes
    d.run()
    assert decoded.output == colocated(tiny_llama_dir, "float32", "auto", [ps[0]], 6)[0]
    p.scheduler.leases.lease_s = 0.05  # nobody pulls this one: it expires
    p.add(ps[1], 1, kv_produce=True)
    p.run()
    p.run_until(lambda: p.scheduler.leases.expired == 1, "the unpulled lease expired")
    nothing_leased(p)


def test_handoff_between_two_pipeline_worlds(tiny_llama_dir: Path) -> None:
    """Each stage's rank pulls its own layers from the producer's rank of its index (two PP 2 worlds)."""
    producer = stage_runners(tiny_llama_dir, BLOCKS, BLOCK, 2)
    consumer = stage_runners(tiny_llama_dir, BLOCKS, BLOCK, 2)
    for r in producer:
        r.handoff = make_handoff(r.kv_cache, r.comm.where, serve=True)
    for r in consumer:
        r.handoff = make_handoff(r.kv_cache, r.comm.where, serve=False)
    ps = prompts(4)[:2]
    expected = colocated(tiny_llama_dir, "float32", "auto", ps, 8)
    try:
        with (
            EngineRun(producer, tokenizer_dir=tiny_llama_dir) as p,
            EngineRun(consumer, tokenizer_dir=tiny_llama_dir) as d,
        ):
            assert [hand_off(p, d, prompt, 8) for prompt in ps] == expected
            assert d.scheduler.leases.imported_blocks == sum((len(x) - 1) // BLOCK for x in ps)
            nothing_leased(p, producer)
    finally:
        close_handoffs(producer + consumer)


def tp_world(folder: Path, tp: int, serve: bool) -> tuple[list[ModelRunner], TensorParallelRanks | None]:
    """A world of `tp` ranks (in-process, over gloo), each with its KV hand-off."""
    world = TensorParallelRanks(folder, BLOCKS, BLOCK, tp=tp) if tp > 1 else None
    runners = world.runners if world is not None else [runner(folder, "float32", "auto")]
    for r in runners:
        r.handoff = make_handoff(r.kv_cache, r.comm.where, serve=serve, total_kv_heads=r.model.config.num_kv_heads)
    return runners, world


@pytest.mark.parametrize(
    ("producer_tp", "consumer_tp"), [(2, 2), (1, 2), (2, 1)], ids=["tp2-tp2", "tp1-tp2", "tp2-tp1"]
)
def test_handoff_between_tensor_parallel_worlds(tiny_llama_dir: Path, producer_tp: int, consumer_tp: int) -> None:
    """Same TP size: rank r pulls from rank r. Other sizes: a TP 2 rank slices its KV head out of the TP 1 rank's
    blocks; the TP 1 rank concatenates the heads of both TP 2 ranks. Greedy tokens are a colocated world's and HF's
    (teacher-forced)."""
    ps = prompts(5)[1:]
    expected = colocated(tiny_llama_dir, "float32", "auto", ps, 8)
    producer, p_world = tp_world(tiny_llama_dir, producer_tp, serve=True)
    consumer, d_world = tp_world(tiny_llama_dir, consumer_tp, serve=False)
    try:
        with (
            EngineRun(producer, tokenizer_dir=tiny_llama_dir, transport=p_world.transport() if p_world else None) as p,
            EngineRun(consumer, tokenizer_dir=tiny_llama_dir, transport=d_world.transport() if d_world else None) as d,
        ):
            outputs = [hand_off(p, d, prompt, 8) for prompt in ps]
            assert d.scheduler.leases.imported_blocks == sum((len(x) - 1) // BLOCK for x in ps)
            assert not d.scheduler.counters.preemptions_recompute, "every pull succeeded"
            staged, framed = pulls(producer)
            assert staged >= len(ps) and not framed, "one host: every rank's pulls go through staging buffers"
            nothing_leased(p, producer)
    finally:
        close_handoffs(producer + consumer)
        for w in (p_world, d_world):
            if w is not None:
                w.close()
    assert outputs == expected
    hf = load_hf(tiny_llama_dir)
    for prompt, out in zip(ps, outputs, strict=True):
        assert_teacher_forced(hf, prompt, out)
