"""Per-request KV precision: full and compact blocks in one engine, the memory-sensitive mode's choice, the fidelity
of a mixed batch, and the memory stats of both pools."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from proto.transport import WorldCapacity
from proto.wire import SamplingOptions, StepPlan, StepResult
from scheduler_node.api.validation import InvalidField, SamplingFields, build_spec
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.precision import BlockFormat, choose_format
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.core.stats import kv_pools
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.kv_compact import CompactKV
from tests.support.models import assert_teacher_forced, load_hf

pytestmark = pytest.mark.model

BLOCK = 8


def _choose(precision: str, priority: int = 50, left_full: int = 10, left_compact: int = 10, **mode: object):  # type: ignore[no-untyped-def]
    config = CompactKV(**{"fraction": 0.5, "under_pressure": True, **mode})  # type: ignore[arg-type]
    left = {BlockFormat.FULL: left_full, BlockFormat.COMPACT: left_compact}
    return choose_format(precision, priority, config, True, left.__getitem__, usable_full=40)


def test_the_choice_follows_the_request_then_the_pressure() -> None:
    assert _choose("full", left_full=-5) is BlockFormat.FULL  # always what it asks, fitting or not
    assert _choose("compact", left_full=30) is BlockFormat.COMPACT
    assert _choose("auto", left_full=10) is BlockFormat.FULL  # 10 left of 40: not below a quarter
    assert _choose("auto", left_full=9) is BlockFormat.COMPACT  # tight
    assert _choose("auto", left_full=9, priority=80) is BlockFormat.FULL  # high priority keeps full precision
    assert _choose("auto", left_full=9, left_compact=-1) is BlockFormat.FULL  # the compact pool has no room
    assert _choose("auto", left_full=-1, under_pressure=False, fraction=0.5) is BlockFormat.FULL  # mode off


def _scheduler(under_pressure: bool, num_full: int = 8, num_compact: int = 8) -> Scheduler:
    config = SchedulerConfig(block_size=BLOCK, max_num_batched_tokens=512, max_num_seqs=16, watermark=0.0)
    precision = CompactKV(0.5, under_pressure=under_pressure)
    return Scheduler(config, num_full, num_compact_blocks=num_compact, precision=precision)


def _add(s: Scheduler, name: str, precision: str = "auto", priority: int = 50) -> Request:
    prompt = [hash((name, i)) % 1000 + 3 for i in range(2 * BLOCK - 1)]  # 2 blocks with the first sampled token
    req = Request(name, prompt, SamplingOptions(0.0), StopConditions(4), priority, kv_precision=precision)
    s.add(req)
    return req


def _formats(s: Scheduler) -> dict[str, set[BlockFormat]]:
    return {r.req_id: {s.blocks.block_format(b) for b in s.blocks.blocks_of(r.req_id)} for r in s.running}


def test_under_pressure_new_low_priority_requests_get_compact_blocks() -> None:
    s = _scheduler(under_pressure=True)
    for name in ("a", "b", "c", "d"):
        _add(s, name)
    _add(s, "urgent", priority=90)
    _add(s, "asks-full", precision="full")
    s.schedule()
    formats = _formats(s)
    full, compact = {BlockFormat.FULL}, {BlockFormat.COMPACT}
    # 8 full blocks, tight below 2 free: a, b, c leave 6, 4, 2 free; d would leave 0, so it is compact. The urgent
    # one keeps full precision and takes the last two; asks-full finds none left and waits.
    assert [formats[n] for n in ("a", "b", "c", "d", "urgent")] == [full, full, full, compact, full]
    assert [r.req_id for r in s.waiting] == ["asks-full"]
    assert s.blocks.num_compact_used == 2 and s.blocks.num_used == 8
    s.blocks.check_invariants()


def test_without_the_mode_auto_requests_wait_for_full_blocks_and_compact_ones_use_the_pool() -> None:
    s = _scheduler(under_pressure=False)
    for name in ("a", "b", "c", "d", "e"):
        _add(s, name)
    _add(s, "small", precision="compact")
    s.schedule()
    assert {n: f for n, f in _formats(s).items()} == {n: {BlockFormat.FULL} for n in ("a", "b", "c", "d")}
    assert [r.req_id for r in s.waiting] == ["e", "small"], "strict order: e waits for full blocks at the head"


def test_prefix_hits_stay_within_a_format() -> None:
    s = _scheduler(under_pressure=False)
    first = _add(s, "first", precision="compact")
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {first.handle: [5]}))  # its first prompt block is cached now
    s.finish(first.req_id, Status.FINISHED_ABORTED)  # and stays cached in the compact pool once freed
    for name, precision in (("again-full", "full"), ("again-compact", "compact")):
        prompt = list(first.prompt_token_ids)
        s.add(Request(name, prompt, SamplingOptions(0.0), StopConditions(4), kv_precision=precision))
    queries = s.counters.prefix_cache_hits
    s.schedule()
    hits = s.counters.prefix_cache_hits - queries
    assert hits == BLOCK, "only the compact request reuses the compact block"
    formats = _formats(s)
    assert formats == {"again-full": {BlockFormat.FULL}, "again-compact": {BlockFormat.COMPACT}}


def test_memory_stats_report_each_format() -> None:
    s = _scheduler(under_pressure=True)
    for name in ("a", "b", "c", "d"):
        _add(s, name)
    s.schedule()
    capacity = WorldCapacity(8, 0, 100, 0.0, 100, "bfloat16", num_compact_blocks=8, compact_world_bytes_per_block=53,
                             compact_format="int8")  # fmt: skip
    device = {p.format: p for p in kv_pools(s, capacity) if p.tier == "device"}
    assert (device["bfloat16"].used_bytes, device["bfloat16"].allocated_bytes) == (6 * 100, 8 * 100)
    assert (device["int8"].used_bytes, device["int8"].allocated_bytes) == (2 * 53, 8 * 53)


@pytest.fixture(scope="module")
def mixed_llm(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",  # compared with HF at 1e-3
        kv_cache_memory="2MiB",
        kv_compact_fraction=0.5,
        enable_prefix_caching=False,
        threads=1,
    ) as llm:
        yield llm


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 21, 40)]


def _greedy(precision: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, kv_precision=precision)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(mixed_llm: LLM, tiny_llama_dir: Path) -> None:
    """Each prompt once in each format, all in one batch; then each alone. A prompt's prefill attends to its own
    new keys at full precision and a prefix hit or an earlier chunk reads them quantized, so the runs are kept
    alike (no prefix cache, no chunking) and compare exactly."""
    prompts = _prompts()
    both = [(p, precision) for p in prompts for precision in ("full", "compact")]  # each prompt in both formats
    mixed = mixed_llm.generate([p for p, _ in both], [_greedy(x) for _, x in both], use_tqdm=False)
    alone = [mixed_llm.generate([p], _greedy(x), use_tqdm=False)[0] for p, x in both]
    hf = load_hf(tiny_llama_dir)
    for (prompt, precision), m, a in zip(both, mixed, alone):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids, (precision, len(prompt))
        if precision == "full":
            assert_teacher_forced(hf, prompt, m.outputs[0].token_ids)
    full_lp = [lp.logprob for m in mixed[0::2] for lp in m.outputs[0].logprobs]  # type: ignore[union-attr]
    compact_lp = [lp.logprob for m in mixed[1::2] for lp in m.outputs[0].logprobs]  # type: ignore[union-attr]
    gaps = [abs(f - c) for f, c in zip(full_lp, compact_lp)]
    assert max(gaps) > 1e-5, "the compact requests read full-precision KV: their logprobs match to the last digit"
    whole_int8 = {"kv_cache_dtype": "int8", "enable_prefix_caching": False}
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="1MiB", threads=1, **whole_int8) as int8:  # type: ignore[arg-type]
        whole = int8.generate(prompts, _greedy("auto"), use_tqdm=False)
    for w, m in zip(whole, mixed[1::2]):
        assert w.outputs[0].token_ids == m.outputs[0].token_ids, "a compact block is an int8 cache's block"
        wl = [lp.logprob for lp in w.outputs[0].logprobs]  # type: ignore[union-attr]
        ml = [lp.logprob for lp in m.outputs[0].logprobs]  # type: ignore[union-attr]
        assert max(abs(x - y) for x, y in zip(wl, ml)) < 1e-4


def test_the_offline_api_checks_the_field(mixed_llm: LLM, tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidField) as err:
        mixed_llm.generate([[5, 6, 7]], SamplingParams(kv_precision="bogus"), use_tqdm=False)
    assert err.value.field == "kv_precision" and "'bogus'" in str(err.value)
    stats = kv_pools(mixed_llm.engine.scheduler, mixed_llm.engine.workers.capacity)
    device = {p.format: p for p in stats if p.tier == "device"}
    assert set(device) == {"float32", "int8"}
    assert device["int8"].bytes_per_block * 3 < device["float32"].bytes_per_block  # D = 64: 68 vs 256 bytes a row
    assert device["int8"].total_blocks > device["float32"].total_blocks  # half the bytes, ~3.8x smaller blocks


def test_compact_needs_a_compact_pool(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="1MiB", threads=1) as llm:
        with pytest.raises(InvalidField, match="kv-compact-fraction") as err:
            llm.generate([[5, 6, 7]], SamplingParams(kv_precision="compact"), use_tqdm=False)
        assert err.value.field == "kv_precision"
        assert llm.engine.compact_tokens == 0


def test_compact_requests_are_never_swapped() -> None:
    table = BlockTable(8, BLOCK, num_host_blocks=8, num_compact_blocks=8)
    table.acquire("c", [], BlockFormat.COMPACT)
    table.acquire("f", [], BlockFormat.FULL)
    assert table.write("c", 0, BLOCK) is not None and table.write("f", 0, BLOCK) is not None
    assert table.can_swap_out("f") and not table.can_swap_out("c")


def test_a_worker_refuses_blocks_of_the_wrong_pool(mixed_llm: LLM) -> None:
    runner = mixed_llm.engine.workers.runners[0]  # type: ignore[attr-defined]
    base = runner.num_blocks
    bad = [
        (StepPlan(1, block_copies=[(0, base)], compact_block_base=base), "crosses KV formats"),
        (StepPlan(1, swap_in=[(0, base)], compact_block_base=base), "full blocks only"),
        (StepPlan(1, block_copies=[(base, base + runner.num_compact_blocks)], compact_block_base=base), "compact"),
    ]
    for plan, words in bad:
        with pytest.raises(ValueError, match=words):
            runner.apply_diffs(plan)


def test_a_world_that_comes_back_smaller_shrinks_the_compact_pool() -> None:
    s = _scheduler(under_pressure=True, num_full=8, num_compact=8)
    s.requeue_all()
    s.fit_capacity(8, 0, 5)
    assert (s.blocks.num_blocks, s.blocks.num_compact_blocks, s.blocks.num_compact_free) == (8, 5, 5)
    s.fit_capacity(8, 0, 9)  # a world never grows back: the table stays as small as its smallest rank
    assert s.blocks.num_compact_blocks == 5


def test_a_compact_request_fits_the_compact_pool_or_is_refused(tiny_llama_dir: Path) -> None:
    tokenizer = ModelTokenizer(tiny_llama_dir)
    spec = build_spec([5] * 50, SamplingFields(), 1024, tokenizer=tokenizer, kv_precision="compact", compact_tokens=64)
    assert (spec.kv_precision, spec.max_tokens) == ("compact", 14), "max_tokens defaults to what the pool holds"
    too_long = {"tokenizer": tokenizer, "kv_precision": "compact", "compact_tokens": 48}
    with pytest.raises(InvalidField, match="fills the compact KV pool") as err:
        build_spec([5] * 50, SamplingFields(), 1024, **too_long)  # type: ignore[arg-type]
    assert err.value.field == "kv_precision"
    with pytest.raises(InvalidField) as err:
        build_spec([5] * 50, SamplingFields(max_tokens=20), 1024, tokenizer=tokenizer, kv_precision="compact",
                   compact_tokens=64)  # fmt: skip
    assert err.value.field == "max_tokens"
    auto = build_spec([5] * 50, SamplingFields(), 1024, tokenizer=tokenizer, compact_tokens=64)
    assert (auto.kv_precision, auto.max_tokens) == ("auto", 974)


def test_auto_requests_that_could_never_finish_in_the_compact_pool_keep_full_blocks() -> None:
    s = _scheduler(under_pressure=True, num_full=8, num_compact=3)
    for name in ("a", "b", "c", "d"):
        _add(s, name)  # 15 prompt tokens + 4 = 3 blocks at most: d fits the compact pool
    prompt = [hash(("long", i)) % 1000 + 3 for i in range(2 * BLOCK - 1)]
    long = Request("long", prompt, SamplingOptions(0.0), StopConditions(20))  # 35 tokens: 5 blocks at most
    s.add(long)
    s.schedule()
    formats = _formats(s)
    assert formats["d"] == {BlockFormat.COMPACT}
    assert formats["long"] == {BlockFormat.FULL}, "the full pool is tight, but the compact one could never hold it"
