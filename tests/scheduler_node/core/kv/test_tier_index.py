"""The KV offload tiers' index: ARC and LRU replacement, the moves it owes the workers, salts, prefix loads."""

from __future__ import annotations

import msgspec
import pytest

from proto.wire import SamplingOptions, StepPlan, StepResult, TierMove, WireError, decode, encode
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv.block_ops import hash_block
from scheduler_node.core.kv.tier_index import KVTiers, Tier
from scheduler_node.core.kv.tier_policy import ArcPolicy, LruPolicy
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler
from tests.support.plans import run_to_end

pytestmark = pytest.mark.model

NONE: set[bytes] = set()


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_lru_evicts_the_least_recently_used() -> None:
    lru = LruPolicy(3)
    for i in range(3):
        assert lru.insert(k(i), NONE) == (True, None)
    lru.touch(k(0))
    assert lru.insert(k(3), NONE) == (True, k(1))
    assert lru.insert(k(4), {k(2)}) == (True, k(0)), "a protected entry is skipped"
    assert lru.insert(k(5), {k(2), k(3), k(4)}) == (False, None), "nothing can make room"


def test_arc_keeps_frequent_blocks_through_a_scan() -> None:
    """Blocks used twice survive a long scan of one-time blocks under ARC; LRU loses them."""
    for policy, survives in ((ArcPolicy(4), True), (LruPolicy(4), False)):
        hot = [k(0), k(1)]
        for key in hot:
            policy.insert(key, NONE)
        for key in hot:
            policy.touch(key)  # seen twice: frequent
        for i in range(100, 120):  # a scan
            policy.insert(k(i), NONE)
        assert all(key in policy for key in hot) is survives, type(policy).__name__
        assert len(policy) == 4


def test_arc_adapts_to_recency_after_ghost_hits() -> None:
    """A key that comes back soon after its eviction from T1 (a B1 ghost hit) grows T1's target and returns as
    frequent (T2)."""
    arc = ArcPolicy(2)
    arc.insert(k(1), NONE)
    arc.insert(k(2), NONE)
    assert arc.insert(k(3), NONE) == (True, k(1))
    assert k(1) in arc.b1 and arc.p == 0
    admitted, victim = arc.insert(k(1), NONE)
    assert admitted and victim is not None and arc.p == 1
    assert k(1) in arc.t2


def test_arc_directory_stays_bounded() -> None:
    arc = ArcPolicy(8)
    for i in range(1000):
        arc.insert(k(i % 37), NONE) if k(i % 37) not in arc else arc.touch(k(i % 37))
        assert len(arc) <= 8
        assert len(arc.t1) + len(arc.b1) <= 9 and len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 17


@pytest.mark.parametrize("policy", ["arc", "lru"])
def test_offload_demotes_to_disk_before_overwriting_a_slot(policy: str) -> None:
    tiers = KVTiers(ram_slots=2, disk_slots=4, policy=policy, bytes_per_block=100)
    for block in range(3):
        tiers.offload(k(block), block)
    moves = tiers.take_moves()
    kinds = [(m.src_tier, m.dst_tier) for m in moves]
    assert kinds == [(0, 1), (0, 1), (1, 2), (0, 1)], "the RAM victim goes to disk before its slot is reused"
    demote, reuse = moves[2], moves[3]
    assert demote.src == reuse.dst and demote.block_hash == k(0) and reuse.block_hash == k(2)
    tiers.offload(k(1), 9)
    assert tiers.take_moves() == [], "a block a tier holds is not copied again"
    assert tiers.match([k(0), k(1), k(2), k(7), k(1)]) == 3
    tiers.load(k(0), 5)
    (load,) = tiers.take_moves()
    assert (load.src_tier, load.src, load.dst_tier, load.dst) == (int(Tier.DISK), demote.dst, 0, 5)
    s = tiers.snapshot()
    assert (s.hits_disk, s.blocks_offloaded, s.blocks_demoted, s.bytes_moved) == (1, 3, 1, 500)
    assert (s.ram_blocks_used, s.disk_blocks_used) == (2, 1)


def test_protected_keys_are_never_displaced() -> None:
    tiers = KVTiers(ram_slots=1, disk_slots=0)
    tiers.offload(k(1), 0)
    with tiers.protecting([k(1)]):
        tiers.offload(k(2), 1)  # no room without displacing k(1): k(2) is dropped
    assert tiers.match([k(1)]) == 1 and tiers.match([k(2)]) == 0


def test_warm_disk_entries_are_adopted() -> None:
    tiers = KVTiers(ram_slots=0, disk_slots=4)
    tiers.adopt_disk([(2, k(7)), (9, k(8)), (3, k(7))])  # out of range and duplicate entries are ignored
    assert tiers.match([k(7)]) == 1 and tiers.match([k(8)]) == 0
    tiers.load(k(7), 0)
    assert tiers.take_moves()[0].src == 2


def test_tier_moves_round_trip_and_are_checked() -> None:
    plan = StepPlan(3, tier_moves=[TierMove(0, 4, 1, 2, k(5)), TierMove(2, 1, 0, 7, k(6))])
    back = decode(encode(plan))
    assert isinstance(back, StepPlan) and back.tier_moves == plan.tier_moves and back.has_work
    bad = msgspec.structs.replace(plan, tier_moves=[TierMove(1, 0, 1, 2, k(1))])
    with pytest.raises(WireError, match="tiers"):
        decode(encode(bad))


def _scheduler(tiers: KVTiers, num_blocks: int = 6) -> Scheduler:
    cfg = SchedulerConfig(block_size=8, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    return Scheduler(cfg, num_blocks, tiers=tiers)


def test_a_prefix_evicted_from_the_device_is_loaded_back_not_recomputed() -> None:
    tiers = KVTiers(ram_slots=8, disk_slots=0)
    s = _scheduler(tiers)
    shared = list(range(100, 124))  # 3 full blocks
    run_to_end(s, "a", shared + [1, 2])
    run_to_end(s, "evict", list(range(500, 541)))  # 6 blocks: the whole pool, a's cached blocks too
    assert s.tiers is not None and s.tiers.stats.blocks_offloaded >= 3
    plans = run_to_end(s, "b", shared + [3, 4])
    loads = [m for m in plans[0].tier_moves if m.dst_tier == 0]
    assert len(loads) == 3 and all(m.src_tier == int(Tier.RAM) for m in loads)
    assert plans[0].num_scheduled_tokens == {plans[0].new_requests[0].handle: 2}, "only the suffix is computed"
    assert plans[0].new_requests[0].num_computed_tokens == 24
    assert [m.dst for m in loads] == plans[0].new_requests[0].block_ids[:3]
    s.blocks.check_invariants()


def test_a_load_the_workers_could_not_do_is_forgotten_and_its_readers_recompute() -> None:
    """The workers report the second block's load failed and both requests that read it left out: the block is in
    neither the tier index nor the device cache any more, both go back to waiting with nothing computed, and when
    one runs again only the first block comes from the cache."""
    tiers = KVTiers(ram_slots=8, disk_slots=0)
    s = _scheduler(tiers)
    shared = list(range(100, 124))  # 3 full blocks
    run_to_end(s, "a", shared + [1, 2])
    run_to_end(s, "evict", list(range(500, 541)))
    first = hash_block(None, shared[:8])
    second = hash_block(first, shared[8:16])
    hashes = [first, second, hash_block(second, shared[16:24])]
    for rid, tail in (("b", [3, 4]), ("c", [5, 6])):
        s.add(Request(rid, shared + tail, SamplingOptions(0.0), StopConditions(1, frozenset())))
    plan = s.schedule()
    b, c = s.requests["b"], s.requests["c"]
    assert len([m for m in plan.tier_moves if m.dst_tier == 0]) == 3 and plan.num_scheduled_tokens == {
        b.handle: 2,
        c.handle: 2,
    }, "b loads the prefix, c finds it in the device cache"
    s.update(plan, StepResult(plan.step_id, {}, failed_loads=[hashes[1]], load_skipped=[b.handle, c.handle]))
    assert tiers.stats.failed_loads == 1 and tiers.match(hashes) == 1
    assert len(s.blocks.match_prefix(hashes)) == 1, "the failed block is not in the device cache"
    assert [(r.status, r.num_computed_tokens) for r in (b, c)] == [(Status.PREEMPTED, 0)] * 2
    s.blocks.check_invariants()
    tiers.check_invariants()
    again = s.schedule()
    assert again.num_scheduled_tokens[b.handle] == 18, "b computes from the failed block on"
    assert not [m for m in again.tier_moves if m.dst_tier == 0]


def test_a_block_the_disk_would_not_store_is_dropped_and_the_disk_tier_turns_off() -> None:
    """A worker reports a disk write it could not do (a full disk): the block is not offered, the disk tier is off
    for good (RAM victims are dropped from now on, a lost world does not bring it back), the RAM tier goes on, and
    the failure is counted."""
    tiers = KVTiers(ram_slots=1, disk_slots=4)
    s = _scheduler(tiers)
    tiers.offload(k(1), 0)
    tiers.offload(k(2), 1)  # k(1) is demoted to disk
    assert tiers.match([k(1)]) == 1
    s.update(s.schedule(), StepResult(0, {}, failed_stores=[k(1)]))
    assert tiers.match([k(1)]) == 0 and tiers.match([k(2)]) == 1, "dropped from disk; RAM keeps its block"
    stats = tiers.snapshot()
    assert (stats.failed_stores, stats.disk_blocks_total) == (1, 0)
    assert stats.as_metrics()["minivllm:kv_tier_failed_stores"] == 1
    tiers.take_moves()
    tiers.offload(k(3), 2)
    assert [(m.src_tier, m.dst_tier) for m in tiers.take_moves()] == [(0, 1)], "the RAM victim is not sent to disk"
    tiers.clear()  # a lost rank
    assert [t.tier for t in tiers.tiers] == [Tier.RAM]
    tiers.check_invariants()


def test_salts_never_cross_in_the_tiers() -> None:
    tiers = KVTiers(ram_slots=32, disk_slots=0)
    s = _scheduler(tiers)
    shared = list(range(100, 124))
    run_to_end(s, "a", shared + [1, 2], salt="tenant-a")
    run_to_end(s, "evict", list(range(500, 541)))
    other = run_to_end(s, "b", shared + [3, 4], salt="tenant-b")
    assert not [m for m in other[0].tier_moves if m.dst_tier == 0], "another salt must not load tenant-a's blocks"
    assert other[0].num_scheduled_tokens == {other[0].new_requests[0].handle: 26}
    run_to_end(s, "evict2", list(range(700, 741)))
    same = run_to_end(s, "c", shared + [5, 6], salt="tenant-a")
    assert len([m for m in same[0].tier_moves if m.dst_tier == 0]) == 3


def test_tier_metrics_are_declared() -> None:
    from scheduler_node.engine.metrics import COUNTERS, GAUGES

    values = KVTiers(ram_slots=1, disk_slots=1).snapshot().as_metrics()
    assert values and set(values) <= set(GAUGES) | set(COUNTERS)
