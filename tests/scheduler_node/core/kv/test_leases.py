"""The scheduler's side of disaggregated prefill/decode (scheduler_node/core/kv/leases.py): a producer's plan
grants a lease on its prompt's full blocks, which stay held after it ends until released or expired, then revoked
in the next plan; an abort holds nothing; a consumer's plan imports the blocks its cache lacks, and a failed import
has it compute them."""

from __future__ import annotations

import pytest

from proto.wire import SamplingOptions, StepPlan, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv.leases import KVSource, new_lease
from scheduler_node.core.policy import PriorityPolicy
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler
from tests.support.plans import scheduled

pytestmark = pytest.mark.unit

BS = 8


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(clock: Clock | None = None) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=BS, max_model_len=256), 32, clock=clock or Clock())


def request(rid: str, n: int = 36, max_tokens: int = 1, **kv: object) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingOptions(0.0), StopConditions(max_tokens), **kv)  # type: ignore[arg-type]


def step(s: Scheduler) -> tuple:  # type: ignore[type-arg]
    plan = s.schedule()
    done = {
        h: [7] for h in plan.num_scheduled_tokens if (r := s.request_of(h)) and r.num_computed_tokens == r.num_tokens
    }
    return plan, s.update(plan, StepResult(plan.step_id, done))


def test_a_producer_whose_last_chunk_is_one_token_still_grants_its_lease() -> None:
    """Its last prompt chunk looks like a steady decode (one token within its own last block, held by the workers);
    the plan that computes it must still grant the lease, so it is not taken on the steady-decode path."""
    s = Scheduler(SchedulerConfig(block_size=BS, max_model_len=256, max_num_batched_tokens=35), 32, clock=Clock())
    lease = new_lease()
    s.add(request("p#0", kv_lease=lease))
    plan, _ = step(s)
    assert scheduled(s, plan) == {"p#0": 35} and not plan.kv_grants, "the first chunk"
    plan, _ = step(s)
    assert [g.lease for g in plan.kv_grants] == [lease] and len(plan.kv_grants[0].blocks) == (36 - 1) // BS
    assert s.leases.held["p"].blocks == plan.kv_grants[0].blocks


def test_a_producer_grants_then_holds_its_prompt_blocks_until_released() -> None:
    s = scheduler()
    lease = new_lease()
    s.add(request("p#0", kv_lease=lease))
    plan, _ = step(s)
    assert [g.lease for g in plan.kv_grants] == [lease]
    granted = plan.kv_grants[0].blocks
    assert len(granted) == (36 - 1) // BS, "the prompt's full blocks but the last token's"
    assert "p#0" not in s.requests
    assert s.leases.num_blocks == 4 and s.blocks.num_used == 4, "held after the request ended"
    assert s.leases.held["p"].blocks == granted
    assert s.release_kv("p") and not s.release_kv("p")
    plan = s.schedule()
    assert plan.kv_revokes == [lease] and plan.has_work, "the revoke is sent even with nothing else to do"
    assert s.blocks.num_used == 0


def test_an_aborted_producer_holds_nothing_and_a_lease_expires() -> None:
    clock = Clock()
    s = scheduler(clock)
    aborted = new_lease()
    s.add(request("a#0", n=60, kv_lease=aborted))
    s.finish("a#0", Status.FINISHED_ABORTED)
    assert s.leases.num_blocks == 0 and s.schedule().kv_revokes == [aborted]
    s.add(request("b#0", kv_lease=new_lease()))
    step(s)
    assert s.leases.num_blocks == 4
    clock.now += s.leases.lease_s
    assert s.expire_leases() == ["b"] and s.leases.num_blocks == 0 and s.blocks.num_used == 0


def test_a_consumer_imports_what_its_cache_lacks_and_recomputes_on_failure() -> None:
    s = scheduler()
    source = KVSource(("127.0.0.1:1",), new_lease(), (9, 8, 7, 6))
    s.add(request("d#0", max_tokens=4, kv_source=source))
    plan, _ = step(s)
    (imp,) = plan.kv_imports
    assert imp.src == [9, 8, 7, 6] and imp.dst == s.blocks.blocks_of("d#0")[:4] and len(imp.hashes) == 4
    assert scheduled(s, plan) == {"d#0": 36 - 4 * BS}, "the last prompt tokens only: the rest is imported"
    assert s.requests["d#0"].kv_source is None, "used once"
    failed = StepResult(plan.step_id + 1, {}, failed_loads=imp.hashes, load_skipped=[s.requests["d#0"].handle])
    plan2 = s.schedule()
    s.update(plan2, failed)
    req = s.requests["d#0"]
    assert req.num_computed_tokens == 0 and req.status is Status.PREEMPTED, "computes its prompt itself"
    assert s.blocks.match_prefix(imp.hashes) == [], "the failed blocks are not offered as a prefix"


def test_migrated_sequences_lease_their_written_blocks_and_a_target_imports_the_partial_one() -> None:
    """Live migration: each sequence of a request keeps the blocks of every position its applied steps wrote (all
    but its last token, less what a plan in flight computes), its partial block included; the request's release
    frees them all. A target imports them and computes only the last token."""
    s = scheduler()
    s.add(request("m#0", n=20, max_tokens=10))
    s.add(request("m#1", n=20, max_tokens=10))
    for _ in range(3):
        step(s)  # the prompt, then two decodes: 23 tokens, positions 0..21 written
    in_flight = s.schedule()  # one more decode in flight: it computes position 22, not needed
    req, lease = s.migrate_out("m#0", keep_kv=True)
    assert req is not None and req.status is Status.FINISHED_MIGRATED and in_flight.has_work
    assert lease is not None and lease.tokens == 22 and len(lease.blocks) == 3, "two full blocks and a partial one"
    assert s.migrate_out("m#1", keep_kv=False)[1] is None, "no exporter: freed at once, the target recomputes"
    assert [g.lease for g in s.schedule().kv_grants] == [lease.lease]
    assert s.leases.num_migrations == 1 and s.release_kv("m") and s.leases.num_migrations == 0
    assert s.blocks.num_used == 0

    target = scheduler()
    outputs = [7] * 3  # the same 23 tokens
    source = lease.source(["127.0.0.1:1"])
    target.add(request("m#2", n=20, max_tokens=10, output_token_ids=outputs, kv_source=source))
    plan, _ = step(target)
    (imp,) = plan.kv_imports
    assert imp.src == lease.blocks and len(imp.dst) == 3 and imp.hashes[2] == b"", "the partial block: no hash"
    assert scheduled(target, plan) == {"m#2": 1}, "only the last token is computed"


def named_step(s: Scheduler) -> tuple[StepPlan, dict[str, int]]:
    """`step`, and the tokens each request computed by name (taken before the result ends any of them)."""
    plan = s.schedule()
    names = scheduled(s, plan)
    live = [s.request_of(h) for h in plan.num_scheduled_tokens]
    done = {r.handle: [7] for r in live if r is not None and r.num_computed_tokens == r.num_tokens}
    s.update(plan, StepResult(plan.step_id, done))
    return plan, names


def leased_sequence(clock: Clock) -> tuple[Scheduler, KVSource, list[int]]:
    """A source that ran `m#0` (20 prompt tokens, 3 outputs) and migrated it off with its KV leased (10 s): the
    source, where its KV waits, and its outputs."""
    source = scheduler(clock)
    source.add(request("m#0", n=20, max_tokens=10))
    for _ in range(3):
        step(source)
    req, lease = source.migrate_out("m#0", keep_kv=True)
    assert req is not None and lease is not None and lease.tokens == 22
    source.schedule()  # grants the lease
    return source, lease.source(["127.0.0.1:1"]), list(req.output_token_ids)


def busy_target(clock: Clock, seats: int, runs: int) -> Scheduler:
    """A target whose `seats` are all taken by requests of `runs` more tokens, with a request of its own waiting."""
    s = Scheduler(SchedulerConfig(block_size=BS, max_model_len=256, max_num_seqs=seats), 32, clock=clock)
    for i in range(seats):
        s.add(request(f"busy{i}#0", n=8, max_tokens=runs))
    step(s)
    s.add(request("own#0", n=8, max_tokens=2))
    return s


def test_a_migrated_sequence_pulls_on_arrival_and_starts_before_the_targets_waiting_requests() -> None:
    """Issue 31: a migrated running sequence arrives at a target whose seats are taken and whose own request
    waits. It claims its blocks and pulls its KV with the next plan, seat or no seat, while the source's lease
    (10 s) still holds it; it then starts before that waiting request, as a preempted one resumes. (It used to
    wait in arrival order for a seat, its KV unpulled: behind 12 s of steps here, the lease was gone first and
    it recomputed.)"""
    clock = Clock()
    source, kv, outputs = leased_sequence(clock)
    target = busy_target(clock, seats=1, runs=12)
    target.add(request("m#0", n=20, max_tokens=10, output_token_ids=outputs, kv_source=kv, migrated_in=True))
    started: list[str] = []
    pulled_while_leased = None
    for _ in range(40):
        clock.now += 1.0  # a step a second: a loaded machine
        source.expire_leases()
        plan, names = named_step(target)
        if any(i.lease == kv.lease for i in plan.kv_imports):
            pulled_while_leased = bool(source.leases.held)
        started += [r for r in names if r not in started]
        if not target.has_work:
            break
    assert pulled_while_leased is True, "the pull went out while the source still held the KV"
    assert started == ["busy0#0", "m#0", "own#0"], "the migrated sequence resumes first"
    counted = target.counters
    assert (counted.migrations_imported, counted.migrations_recomputed) == (1, 0)
    assert target.blocks.num_used == 0


def test_sibling_sequences_all_pull_in_the_first_plan_with_one_seat() -> None:
    """n = 2 moved to a target with one free seat: the router releases the source's leases (an Abort of the
    request) once the target's first token comes, so the sibling that waits for a seat must have pulled by then
    (it used to pull only when it started: after the release, and it recomputed)."""
    clock = Clock()
    target = Scheduler(SchedulerConfig(block_size=BS, max_model_len=256, max_num_seqs=1), 32, clock=clock)
    sources = [KVSource(("127.0.0.1:1",), new_lease(), (5 + 3 * i, 6 + 3 * i, 7 + 3 * i), 22) for i in range(2)]
    for i, kv in enumerate(sources):
        outputs = [7, 8 + i, 9]
        target.add(request(f"m#{i}", n=20, max_tokens=10, output_token_ids=outputs, kv_source=kv, migrated_in=True))
    plan = target.schedule()
    assert sorted(i.lease for i in plan.kv_imports) == sorted(kv.lease for kv in sources), "both pull now"
    assert scheduled(target, plan) == {"m#0": 1}, "one seat: the other waits, its KV pulled"
    assert target.requests["m#1"].pulling
    done = {target.requests["m#0"].handle: [7]}
    target.update(plan, StepResult(plan.step_id, done))
    assert not target.requests["m#1"].pulling and target.requests["m#1"].num_computed_tokens == 22


def test_a_waiting_sequence_whose_pull_failed_lets_its_blocks_go_and_recomputes() -> None:
    """A migrated sequence that pulled while it waited for a seat, and whose pull failed (the source gone, its lease
    released): it never starts from the blocks the pull should have filled; it recomputes, counted so."""
    clock = Clock()
    target = busy_target(clock, seats=1, runs=3)
    kv = KVSource(("127.0.0.1:1",), new_lease(), (5, 6, 7), 22)
    target.add(request("m#0", n=20, max_tokens=10, output_token_ids=[7, 7, 7], kv_source=kv, migrated_in=True))
    plan = target.schedule()
    (imp,) = plan.kv_imports
    req = target.requests["m#0"]
    busy = target.requests["busy0#0"].handle
    after = target.schedule()  # built before the pull's result is back
    assert req.pulling and after.kv_imports == [] and scheduled(target, after) == {"busy0#0": 1}, "it waits"
    target.update(plan, StepResult(plan.step_id, {busy: [7]}, failed_loads=imp.hashes))
    target.update(after, StepResult(after.step_id, {busy: [7]}))
    assert not req.pulling and req.num_computed_tokens == 0 and not target.blocks.blocks_of("m#0")
    assert (target.counters.migrations_imported, target.counters.migrations_recomputed) == (0, 1)
    computed = 0
    for _ in range(40):
        computed += named_step(target)[1].get("m#0", 0)
        if "m#0" not in target.requests:
            break
    assert computed >= 20, "it computed prompt + outputs itself"


def test_a_sequence_taken_back_releases_its_own_lease_once_it_pulled() -> None:
    """A replica whose migrated sequence comes back to it (no other replica took it; a rebalance's source serves
    on) pulls from its own lease: that lease is released as soon as the pull is done, not after 10 s."""
    clock = Clock()
    s, kv, outputs = leased_sequence(clock)
    assert s.leases.num_migrations == 1
    s.add(request("m#1", n=20, max_tokens=10, output_token_ids=outputs, kv_source=kv, migrated_in=True))
    plan, _ = step(s)
    assert [i.lease for i in plan.kv_imports] == [kv.lease]
    assert s.leases.num_migrations == 0 and kv.lease in s.schedule().kv_revokes, "released at once"
    assert s.counters.migrations_imported == 1


def test_a_migrated_sequence_holding_its_kv_still_yields_to_a_higher_priority_class() -> None:
    """Under `priority`, a realtime request waiting to compute its prompt starts before a batch-class migrated
    sequence that pulled its KV on arrival (it holds blocks, yet ranks below), which follows."""
    config = SchedulerConfig(block_size=BS, max_model_len=256, max_num_seqs=1)
    s = Scheduler(config, 32, policy=PriorityPolicy(), clock=Clock())
    s.add(request("busy#0", n=8, max_tokens=3, priority=90))
    named_step(s)
    kv = KVSource(("127.0.0.1:1",), new_lease(), (5, 6, 7), 22)
    s.add(request("m#0", n=20, max_tokens=6, output_token_ids=[7, 7, 7], kv_source=kv, migrated_in=True, priority=30))
    s.add(request("rt#0", n=8, max_tokens=2, priority=90))
    started: list[str] = []
    for _ in range(20):
        plan, names = named_step(s)
        assert not plan.kv_imports or s.requests["m#0"].num_computed_tokens == 22, "pulled on arrival"
        started += [r for r in names if r not in started]
        if not s.has_work:
            break
    assert started == ["busy#0", "rt#0", "m#0"]
    assert s.counters.migrations_imported == 1 and s.num_preemptions == 0
