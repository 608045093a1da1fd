"""The scheduler's parts on their own, each built from what it is handed: the queues, preemption, the capacity, the
blocks a start claims, migrated sequences' pulls, the plan writer, the running pass, admission's floor and applying
an interrupted result. (How they compose into steps: test_scheduler.py and test_scheduler_parts.py.)"""

from __future__ import annotations

import pytest

from proto.wire import ExecutionMode, KVImport, SamplingOptions, StepPlan, StepResult
from scheduler_node.core.admission import Admission
from scheduler_node.core.block_claims import BlockClaims
from scheduler_node.core.capacity import Capacity
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.counters import SchedulerCounters
from scheduler_node.core.in_flight import InFlightLedger
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.leases import KVLeases, KVSource
from scheduler_node.core.kv.precision import CompactKV
from scheduler_node.core.lifecycle import Lifecycle
from scheduler_node.core.migrations_in import MigrationsIn
from scheduler_node.core.policy import Policy, PriorityPolicy
from scheduler_node.core.preemption import Preemption, PreemptionCosts
from scheduler_node.core.quarantine import Quarantine
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.results import Results
from scheduler_node.core.running_pass import RunningPass
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.core.step import PlanWriter, Step
from scheduler_node.core.worker_view import WorkerView

pytestmark = pytest.mark.unit

BS = 8


def req(rid: str, prompt: int = 6, max_tokens: int = 8, priority: int = 0, first: int = 10) -> Request:
    return Request(rid, list(range(first, first + prompt)), SamplingOptions(0.0), StopConditions(max_tokens), priority)


def running(queues: RequestQueues, *reqs: Request) -> None:
    for r in reqs:
        queues.register(r)
        queues.enqueue(r)
        queues.start_running(r)


def test_the_queues_keep_a_stable_policys_order_and_let_a_finished_request_out_of_running() -> None:
    queues = RequestQueues(PriorityPolicy(), lambda: 0.0)
    low, high, mid = req("low", priority=1), req("high", priority=9), req("mid", priority=5)
    for r in (low, high, mid):
        queues.register(r)
        queues.enqueue(r)
    assert [r.req_id for r in queues.waiting] == ["high", "mid", "low"]
    queues.start_running(mid)
    mid.status = Status.FINISHED_LENGTH  # its tokens ended it: it still sits in running
    assert queues.remove("mid") is mid and queues.running == [] and not queues.is_live(mid)
    assert queues.request_of(high.handle) is high and queues.num_unfinished == 2
    with pytest.raises(KeyError, match="already live"):
        queues.check_new([req("high")])


def test_a_request_that_caught_up_leaves_the_catching_up_set_for_good() -> None:
    queues = RequestQueues(Policy(), lambda: 0.0)
    a, b = req("a"), req("b")
    running(queues, a, b)
    assert set(queues.catching_up_pending(lambda h: False)) == {a, b}
    a.num_computed_tokens = 5  # one prompt token to go: the step that samples its first token, no prefill
    assert a.tokens_to_schedule() == 1
    assert queues.catching_up_pending(lambda h: h == b.handle) == []  # b is held by a plan in flight
    b.num_computed_tokens = 5
    assert queues.catching_up_pending(lambda h: False) == []
    b.num_computed_tokens = 2  # rolled back: only `catching_up` brings it back
    assert queues.catching_up_pending(lambda h: False) == []
    queues.catching_up(b)
    assert queues.catching_up_pending(lambda h: False) == [b]


def make_preemption(
    num_blocks: int = 4, host: int = 0, mode: str = "recompute"
) -> tuple[Preemption, RequestQueues, BlockTable]:
    config = SchedulerConfig(block_size=BS, preemption_mode=mode)  # type: ignore[arg-type]
    queues, blocks = RequestQueues(Policy(), lambda: 0.0), BlockTable(num_blocks, BS, num_host_blocks=host)
    view = WorkerView(tokens_in_plan=False)
    return Preemption(config, queues, blocks, view, Policy(), PreemptionCosts(), SchedulerCounters()), queues, blocks


def test_a_request_short_of_blocks_preempts_the_least_valued_after_it_or_waits_for_the_held_ones() -> None:
    preemption, queues, blocks = make_preemption()
    a, b, c = req("a"), req("b"), req("c")
    running(queues, a, b, c)
    for r in (a, b, c):
        assert blocks.write(r.req_id, 0, BS) is not None  # one block each, one left
    c.num_computed_tokens = BS
    written, preempted = preemption.write_or_preempt(a, BS, 2 * BS, [b, c], None, 0.0)  # two blocks
    assert written is not None and preempted and c.status is Status.PREEMPTED and queues.waiting == [c]
    assert blocks.blocks_of("c") == [] and c.num_computed_tokens == 0 and preemption.counters.num_preemptions == 1
    # b is in a plan in flight: a waits for its result rather than preempt itself
    written, preempted = preemption.write_or_preempt(a, 3 * BS, 2 * BS, [b], lambda h: h == b.handle, 0.0)
    assert written is None and not preempted and a.status is Status.RUNNING
    written, preempted = preemption.write_or_preempt(a, 3 * BS, 2 * BS, [b], None, 0.0)  # else b goes, then a
    assert written is None and preempted and a.status is b.status is Status.PREEMPTED


def test_swap_preemption_keeps_the_computed_tokens_but_the_last() -> None:
    preemption, queues, blocks = make_preemption(host=4, mode="swap")
    a = req("a")
    running(queues, a)
    blocks.write("a", 0, 9)
    a.num_computed_tokens, a.output_token_ids = 9, [1, 2, 3]
    preemption.preempt(a)
    assert a.swapped and a.num_computed_tokens == 8 and len(blocks.host_blocks_of("a")) == 2
    assert preemption.counters.preemptions_swap == 1 and queues.waiting == [a] and queues.running == []


def test_the_capacity_caps_max_model_len_and_refuses_a_resize_that_strands_a_request() -> None:
    blocks, queues, view = BlockTable(8, BS), RequestQueues(Policy(), lambda: 0.0), WorkerView(False)
    capacity = Capacity(SchedulerConfig(block_size=BS, max_model_len=20), blocks, queues, view, SchedulerCounters())
    assert capacity.max_model_len == 20  # configured: 8 blocks hold 64
    long = req("long", prompt=6, max_tokens=10)  # 16 tokens at most: 2 blocks
    queues.register(long)
    blocks.write("pad", 0, 4 * BS)  # blocks 0-3
    blocks.write("long", 0, 6)  # block 4
    blocks.free("pad")
    with pytest.raises(MemoryError, match="1 live sequence"):
        capacity.resize(1)  # 8 tokens: it could never finish
    assert blocks.usable_blocks == 8 and blocks.blocks_of("long") == [4]
    assert capacity.resize(2) == 1 and capacity.max_model_len == 16  # its block moves below the limit
    assert blocks.blocks_of("long") == [0]
    plan = StepPlan(1)
    view.finish_plan(plan, blocks.take_ops())
    assert plan.block_updates == {} and plan.block_copies == [(4, 0)]  # the workers do not hold it yet


def test_a_claim_reuses_the_cached_prefix_and_counts_the_hit() -> None:
    config = SchedulerConfig(block_size=BS, watermark=0.5)
    queues, blocks, counters = RequestQueues(Policy(), lambda: 0.0), BlockTable(8, BS), SchedulerCounters()
    leases = KVLeases()
    migrations = MigrationsIn(queues, blocks, leases, counters)
    claims = BlockClaims(config, queues, blocks, CompactKV(), None, leases, migrations, counters)
    first = req("first", prompt=17)
    queues.register(first)
    assert claims.claim(first, 64) and first.num_computed_tokens == 0
    blocks.write("first", 0, 17)
    blocks.register("first", first.update_block_hashes(BS))
    blocks.free("first")
    again = req("again", prompt=17)  # the same prompt: two cached blocks, its last token computed
    queues.register(again)
    need, hits, loads, _ = claims.blocks_to_start(again, 64)
    assert (len(hits), loads) == (2, 0) and need == 3  # the two cached blocks sit on the free list
    assert claims.watermark(claims.blocks.format_of("again")) == 0  # nothing runs: none kept free
    assert claims.claim(again, 64) and again.num_computed_tokens == 16 and again.num_cached_tokens == 16
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (34, 16)


def test_a_migrated_sequence_counts_as_imported_until_its_pull_fails() -> None:
    queues, blocks, counters, leases = (
        RequestQueues(Policy(), lambda: 0.0),
        BlockTable(8, BS),
        SchedulerCounters(),
        KVLeases(),
    )
    migrations = MigrationsIn(queues, blocks, leases, counters)
    seq = req("seq", prompt=9)
    seq.migrated_in, seq.kv_source = True, KVSource(("addr",), b"L" * 16, (0,), tokens=8)
    queues.register(seq)
    migrations.arrive(seq)
    assert migrations.arrivals() == [(seq, False)]
    migrations.count(seq, 8, 8)
    assert counters.migrations_imported == 1 and seq.migration_imports and not seq.migrated_in
    blocks.write("seq", 0, 8)
    seq.pulling = True
    migrations.pull(seq, KVImport(["addr"], b"L" * 16, [0], blocks.blocks_of("seq"), [b"h0"]))
    assert migrations.pulls_last(seq)
    migrations.send(7)
    migrations.settle(7, [b"h0"])  # its pull failed: its blocks go, and it recomputes
    assert blocks.blocks_of("seq") == [] and not seq.pulling and seq.num_computed_tokens == 0
    assert (counters.migrations_imported, counters.migrations_recomputed) == (0, 1)


def test_a_finished_producers_prompt_blocks_stay_under_its_lease_and_an_aborted_one_revokes_it() -> None:
    queues, blocks, view, leases = (
        RequestQueues(Policy(), lambda: 0.0),
        BlockTable(8, BS),
        WorkerView(False),
        KVLeases(),
    )
    migrations = MigrationsIn(queues, blocks, leases, SchedulerCounters())
    lifecycle = Lifecycle(
        queues, blocks, view, leases, InFlightLedger(False), Quarantine(), None, migrations, lambda: 1.0
    )
    done, gone = req("done", prompt=17), req("gone", prompt=17)
    done.kv_lease, gone.kv_lease = b"D" * 16, b"G" * 16
    for r in (done, gone):
        lifecycle.add(r)
        queues.start_running(r)
        blocks.write(r.req_id, 0, 17)
        r.num_computed_tokens = 17
    kept = blocks.blocks_of("done")[:2]
    done.status = Status.FINISHED_LENGTH  # its one output token ended it
    assert lifecycle.finish("done", Status.FINISHED_ABORTED) is done and done.status is Status.FINISHED_LENGTH
    assert leases.held["done"].blocks == kept and not any(blocks.is_free(b) for b in kept)
    assert lifecycle.finish("gone", Status.FINISHED_ABORTED) is gone and leases.revokes == [b"G" * 16]
    assert gone.status is Status.FINISHED_ABORTED and queues.num_unfinished == 0 and blocks.num_free == 6
    assert lifecycle.finish("gone", Status.FINISHED_ABORTED) is None


def test_the_plan_writer_grants_a_producers_lease_once_its_prompt_is_computed() -> None:
    view, blocks, leases = WorkerView(False), BlockTable(8, BS), KVLeases()
    writer = PlanWriter(view, blocks, leases)
    producer = req("p", prompt=9)
    producer.kv_lease, producer.handle = b"L" * 16, 0
    plan, step = StepPlan(1), Step(StepPlan(1), 0.0, 64, 8, float("-inf"), None, None)
    written = blocks.write("p", 0, 9)
    assert written is not None
    writer.take(producer, 9, True, plan, step.sent, written)
    assert [(g.lease, g.blocks) for g in leases.grants] == [(b"L" * 16, blocks.blocks_of("p")[:1])]
    assert producer.num_computed_tokens == 9 and producer.num_placeholders == 1 and step.sent.total_tokens == 9


def scheduler_of_decodes(n: int) -> Scheduler:
    """A scheduler whose `n` requests computed their prompts and sampled their first tokens: steady decodes."""
    s = Scheduler(SchedulerConfig(block_size=BS, max_num_batched_tokens=64), 32, mode=ExecutionMode())
    for i in range(n):
        s.add(req(f"r{i}", prompt=5, first=10 * i))
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {h: [1] for h in plan.num_scheduled_tokens}))
    return s


def test_the_running_pass_takes_steady_decodes_on_the_tables_in_place_test_alone() -> None:
    s = scheduler_of_decodes(3)
    passes: RunningPass = s.running_pass

    def no_write(*args: object) -> None:
        raise AssertionError("a steady decode asked for a write")

    s.blocks.write = no_write  # type: ignore[method-assign,assignment]
    step = Step(StepPlan(9), 0.0, 10, 8, float("-inf"), None, None)
    assert not passes.run(step)
    assert step.budget == 7 and step.sent.decode_firsts == [5, 5, 5]
    assert [r.num_computed_tokens for r in s.running] == [6, 6, 6]


def test_admissions_floor_holds_back_prefill_below_a_waiting_request_that_outranks_it() -> None:
    s = Scheduler(SchedulerConfig(block_size=BS, max_model_len=64), 32, PriorityPolicy(preemption_margin=5))
    admission: Admission = s.admission
    s.add(req("low", priority=1))
    assert admission.prefill_floor(0.0) == 1 - 5
    s.add(req("high", priority=20))
    assert admission.prefill_floor(0.0) == 20 - 5


def test_an_interrupted_result_rolls_its_requests_back_to_catch_up_again() -> None:
    s = scheduler_of_decodes(2)
    results: Results = s.results
    plan = s.schedule()
    assert results.update(plan, StepResult(plan.step_id, {}, interrupted=True)) == []
    assert [(r.num_computed_tokens, r.num_placeholders) for r in s.running] == [(5, 0), (5, 0)]
    assert s.counters.interrupted_steps == 1


def test_a_new_configuration_reaches_every_part_that_reads_one() -> None:
    """A benchmark narrows max_num_seqs between runs (scripts/bench_spec.py): admission seats that many from then on."""
    s = Scheduler(SchedulerConfig(block_size=BS, max_num_seqs=4), 32)
    s.config = SchedulerConfig(block_size=BS, max_num_seqs=2, watermark=0.5)
    for i in range(3):
        s.add(req(f"r{i}"))
    plan = s.schedule()
    assert len(plan.new_requests) == 2 and len(s.waiting) == 1
    parts = [s.capacity.config, s.preemption.config, s.claims.config, s.admission.config]
    assert all(c is s.config for c in parts)


def test_the_running_pass_schedules_what_tokens_to_schedule_says() -> None:
    """The pass has `Request.tokens_to_schedule` inline (it runs for every request at every step): the two agree
    on a request at its max_tokens with a token in flight, a steady decode and one rolled back to mid-prompt."""
    s = scheduler_of_decodes(3)
    done, steady, rolled = s.running
    done.stop = StopConditions(2)
    done.num_placeholders = 1  # its last token is in flight: nothing more to compute
    rolled.num_computed_tokens = 2
    expected = {r.handle: r.tokens_to_schedule() for r in s.running}
    assert expected == {done.handle: 0, steady.handle: 1, rolled.handle: 4}
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {h: n for h, n in expected.items() if n}
