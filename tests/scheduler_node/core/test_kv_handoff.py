"""The scheduler's side of disaggregated prefill/decode (scheduler_node/core/kv_handoff.py): a producer's plan
grants a lease on its prompt's full blocks, which stay held after it ends until released or expired, then revoked
in the next plan; an abort holds nothing; a consumer's plan imports the blocks its cache lacks, and a failed import
has it compute them."""

from __future__ import annotations

import pytest

from proto.wire import SamplingOptions, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv_handoff import KVSource, new_lease
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
