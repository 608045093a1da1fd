"""The KV event sink: the block table and the offload tiers report exactly the hashes that enter and leave the
prefix cache (per tier), through allocation, prefix hits, reuse of cached blocks, resize, failed loads, a lost
world; the sink's mirror always equals what the caches hold."""

from __future__ import annotations

import pytest

from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv import relocation as block_relocation
from scheduler_node.core.kv.block_ops import hash_block
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.prefix_events import CLEARED, DEVICE, DISK, RAM, REMOVED, STORED, KVEventSink
from scheduler_node.core.kv.tier_index import KVTiers
from scheduler_node.core.scheduler import Scheduler
from tests.support.plans import run_to_end

pytestmark = pytest.mark.unit

BS = 8


def chain(tokens: list[int], salt: str = "") -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // BS):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * BS : (i + 1) * BS], salt))
    return hashes


def device_cached(bt: BlockTable) -> set[bytes]:
    return set(bt._cached) | set(bt._compact_cached)


def table(num_blocks: int = 4) -> tuple[BlockTable, KVEventSink]:
    bt = BlockTable(num_blocks, BS)
    bt.events = sink = KVEventSink()
    return bt, sink


def test_registered_blocks_are_stored_once_with_their_parent_and_a_prefix_hit_stores_nothing() -> None:
    bt, sink = table()
    hashes = chain(list(range(24)))
    assert bt.write("a", 0, 24) is not None
    bt.register("a", hashes)
    assert sink.take() == [(STORED, DEVICE, hashes[0], None), (STORED, DEVICE, hashes[1], hashes[0]),
                           (STORED, DEVICE, hashes[2], hashes[1])]  # fmt: skip
    bt.free("a")  # lazy free: the blocks keep their hashes
    bt.acquire("b", bt.match_prefix(hashes))
    bt.register("b", hashes)
    assert sink.take() == [], "a prefix hit and a second registration change nothing"
    assert sink.held[DEVICE] == device_cached(bt) == set(hashes)


def test_a_cached_block_handed_out_again_is_removed_and_resize_drops_free_ones() -> None:
    bt, sink = table(num_blocks=4)
    hashes = chain(list(range(24)))
    bt.write("a", 0, 24)
    bt.register("a", hashes)
    bt.free("a")  # tail first: the block of hashes[2] is reused first
    sink.take()
    bt.write("b", 0, 16)  # two blocks: the never-cached free block, then the LRU cached one
    assert sink.take() == [(REMOVED, DEVICE, hashes[2], None)]
    assert sink.held[DEVICE] == device_cached(bt)
    before = device_cached(bt)
    block_relocation.resize(bt, 2)  # b's blocks move below 2, over the cached ones there
    removed = [e[2] for e in sink.take() if e[0] == REMOVED and e[2] is not None]
    assert sorted(removed) == sorted(before - device_cached(bt)) and len(removed) == 2
    assert sink.held[DEVICE] == device_cached(bt)
    for h in list(device_cached(bt)):
        bt.uncache(h)
    assert sink.held[DEVICE] == set() and all(e[0] == REMOVED for e in sink.take())


def test_a_hash_in_both_pools_is_removed_only_when_its_last_copy_goes() -> None:
    bt = BlockTable(2, BS, num_compact_blocks=2)
    bt.events = sink = KVEventSink()
    hashes = chain(list(range(8)))
    bt.write("full", 0, 8)
    bt.register("full", hashes)
    bt.acquire("compact", [], fmt=bt.format_of("x").COMPACT)
    bt.write("compact", 0, 8)
    bt.register("compact", hashes)
    assert sink.take() == [(STORED, DEVICE, hashes[0], None)]
    bt.uncache(hashes[0])  # the full copy goes; the compact one stays
    assert sink.take() == [] and sink.held[DEVICE] == {hashes[0]}


def test_tiers_report_stores_demotions_failures_and_clears() -> None:
    tiers = KVTiers(ram_slots=1, disk_slots=2, policy="lru")
    tiers.events = sink = KVEventSink()
    a, b, c = (bytes([i]) * 16 for i in range(3))
    tiers.offload(a, 0)
    tiers.offload(b, 1)  # a is displaced from RAM and demoted to disk
    assert sink.take() == [(STORED, RAM, a, None), (REMOVED, RAM, a, None), (STORED, RAM, b, None),
                           (STORED, DISK, a, None)]  # fmt: skip
    tiers.forget_failed([a])
    assert sink.take() == [(REMOVED, DISK, a, None)]
    tiers.offload(c, 2)
    tiers.drop_failed_stores([c])  # the disk turns off
    assert sink.held == {DEVICE: set(), RAM: set(), DISK: set()}
    assert sink.take()[-1] == (CLEARED, DISK, None, None)
    tiers.adopt_disk([(0, a)])  # no disk tier any more: nothing adopted
    tiers.clear()
    assert sink.take() == [] and len(sink) == 0


def test_the_scheduler_reports_a_run_a_reuse_and_a_lost_world() -> None:
    """Through the scheduler: a prompt's full blocks are stored as its steps compute them, a second prompt that
    needs the whole pool evicts them (offloaded to RAM: stored there), and a lost world clears the device."""
    cfg = SchedulerConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    tiers = KVTiers(ram_slots=8, disk_slots=0)
    s = Scheduler(cfg, 6, tiers=tiers)
    sink = KVEventSink()
    s.attach_kv_events(sink)
    shared = list(range(100, 124))
    run_to_end(s, "a", shared + [1, 2])
    assert [e for e in sink.take() if e[0] == STORED] == [(STORED, DEVICE, h, p) for h, p in
                                                          zip(chain(shared), [None, *chain(shared)[:2]])]  # fmt: skip
    run_to_end(s, "evict", list(range(500, 541)))
    assert set(chain(shared)) <= sink.held[RAM]
    assert sink.held[DEVICE] == device_cached(s.blocks)
    s.requeue_all()
    assert (CLEARED, DEVICE, None, None) in sink.take() and sink.held[DEVICE] == set() and sink.held[RAM] == set()
    run_to_end(s, "again", shared + [3])
    assert sink.held[DEVICE] == device_cached(s.blocks) == set(chain(shared))
