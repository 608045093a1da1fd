"""The KV offload tiers' index: which evicted prefix blocks sit in the workers' host RAM and on their disks.

The scheduler owns the index; each worker rank keeps its own shard of every block in the slots the index names.
A cached block that the device pool hands out again is offloaded (device -> RAM), a RAM victim goes to disk
(RAM -> disk), and a request whose prefix misses the device cache but hits a tier loads those blocks back (tier
-> device) instead of recomputing them. The moves are collected in generation order and travel with the next
plan (`StepPlan.tier_moves`); the workers run them in that order before the plan's swaps, copies and forward
pass, so a slot is always read before it is overwritten.

Entries are keyed by the chained block hash, which the request's cache_salt seeds: salts never share blocks.
Replacement is ARC (adaptive: recency and frequency, with ghost lists of recent victims) or LRU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from proto.wire import StepResult, TierMove
from scheduler_node.core.kv.block_ops import BlockHash
from scheduler_node.core.kv.prefix_events import KVEventSink
from scheduler_node.core.kv.tier_policy import make_tier_policy

logger = logging.getLogger(__name__)


class Tier(IntEnum):
    DEVICE = 0
    RAM = 1
    DISK = 2


class TierIndex:
    """One tier: which block hash sits in which of its slots, and the policy that picks victims."""

    def __init__(self, tier: Tier, num_slots: int, policy: str) -> None:
        self.tier = tier
        self.num_slots = num_slots
        self.policy = make_tier_policy(policy, num_slots)
        self._slot_of: dict[BlockHash, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._slot_of

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def slot_of(self, key: BlockHash) -> int | None:
        return self._slot_of.get(key)

    def touch(self, key: BlockHash) -> None:
        self.policy.touch(key)

    def put(self, key: BlockHash, protected: set[BlockHash]) -> tuple[int, tuple[BlockHash, int] | None] | None:
        """A slot for `key` (not resident) and the (hash, slot) it displaced; None when every resident is
        protected (nothing can make room)."""
        admitted, victim = self.policy.insert(key, protected)
        if not admitted:
            return None
        displaced = None
        if victim is not None:
            displaced = (victim, self._slot_of.pop(victim))
            slot = displaced[1]
        else:
            slot = self._free.pop()
        self._slot_of[key] = slot
        return slot, displaced

    def forget(self, key: BlockHash) -> None:
        """Drop `key` (its copy here turned out not to be valid); its slot is free again."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self.policy.remove(key)
            self._free.append(slot)

    def adopt(self, key: BlockHash, slot: int) -> None:
        """A block found in this slot at start (a warm disk tier)."""
        if key in self._slot_of or slot not in self._free or not self.policy.insert(key, set())[0]:
            return
        self._free.remove(slot)
        self._slot_of[key] = slot


@dataclass(slots=True)
class KVTierStats:
    """The tiers' counters, for the stats and metrics paths (blocks, bytes of one rank's shards summed)."""

    ram_blocks_total: int = 0
    ram_blocks_used: int = 0
    disk_blocks_total: int = 0
    disk_blocks_used: int = 0
    hits_ram: int = 0  # blocks loaded back from RAM instead of being recomputed
    hits_disk: int = 0
    failed_loads: int = 0  # loads a worker could not do (the disk copy failed its check; counted in the hits too)
    failed_stores: int = 0  # disk writes a worker could not do (a full or failing disk): the first turns disk off
    blocks_offloaded: int = 0  # device -> a tier
    blocks_demoted: int = 0  # RAM -> disk
    bytes_moved: int = 0
    move_ms: float = 0.0  # the workers' time spent moving tier blocks (loads, offloads, demotions)
    move_steps: int = 0  # steps that moved tier blocks
    load_ms: float = 0.0  # of move_ms, loading blocks back into the device cache (on the way of a request's compute)
    load_step_ms: float = 0.0  # the whole execution time of the steps that loaded blocks
    load_steps: int = 0

    @property
    def mean_move_ms(self) -> float:
        return self.move_ms / self.move_steps if self.move_steps else 0.0

    def as_metrics(self) -> dict[str, float]:
        """The values the metrics endpoint exports (names in scheduler_node/engine/metrics.py)."""
        return {
            "minivllm:kv_tier_ram_blocks_used": self.ram_blocks_used,
            "minivllm:kv_tier_disk_blocks_used": self.disk_blocks_used,
            "minivllm:kv_tier_mean_move_ms": self.mean_move_ms,
            "minivllm:kv_tier_ram_hits": self.hits_ram,
            "minivllm:kv_tier_disk_hits": self.hits_disk,
            "minivllm:kv_tier_bytes_moved": self.bytes_moved,
            "minivllm:kv_tier_failed_loads": self.failed_loads,
            "minivllm:kv_tier_failed_stores": self.failed_stores,
        }


@dataclass(slots=True)
class KVTiers:
    """The scheduler's index of the RAM and disk tiers and the moves it owes the workers."""

    ram_slots: int
    disk_slots: int
    policy: str = "arc"
    bytes_per_block: int = 0  # one rank's shard of one block
    tiers: list[TierIndex] = field(init=False)
    stats: KVTierStats = field(init=False)
    _moves: list[TierMove] = field(init=False, default_factory=list)
    _protected: set[BlockHash] = field(init=False, default_factory=set)
    events: KVEventSink | None = field(init=False, default=None)  # told what enters and leaves each tier

    def __post_init__(self) -> None:
        make_tier_policy(self.policy, 0)  # checks the name
        self.stats = KVTierStats(ram_blocks_total=self.ram_slots, disk_blocks_total=self.disk_slots)
        self.clear()

    def clear(self) -> None:
        """Forget every entry (a rank was lost: until the world is back, nothing the workers hold is known); the
        counters stay."""
        sizes = ((Tier.RAM, self.ram_slots), (Tier.DISK, self.disk_slots))
        self.tiers = [TierIndex(tier, n, self.policy) for tier, n in sizes if n > 0]
        self._moves = []
        if self.events is not None:
            self.events.cleared(Tier.RAM)
            self.events.cleared(Tier.DISK)

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def adopt_disk(self, entries: Iterable[tuple[int, BlockHash]]) -> None:
        """Blocks every rank found intact on its disk at start: a warm start, or a world back after a lost rank."""
        for tier in self.tiers:
            if tier.tier is Tier.DISK:
                for slot, key in entries:
                    if 0 <= slot < tier.num_slots:
                        tier.adopt(key, slot)
                        if self.events is not None and key in tier:
                            self.events.stored(Tier.DISK, key)

    # ---- the block table's eviction hook

    def offload(self, key: BlockHash, device_block: int) -> None:
        """A cached device block is handed out again: keep its KV in the first tier (unless a tier holds it)."""
        if self.tiers and not any(key in t for t in self.tiers):
            if self._store(0, key, Tier.DEVICE, device_block):
                self.stats.blocks_offloaded += 1

    def _store(self, index: int, key: BlockHash, src_tier: Tier, src: int) -> bool:
        tier = self.tiers[index]
        placed = tier.put(key, self._protected)
        if placed is None:
            return False
        slot, displaced = placed
        if self.events is not None:
            if displaced is not None:
                self.events.removed(tier.tier, displaced[0])
            self.events.stored(tier.tier, key)
        if displaced is not None and index + 1 < len(self.tiers) and displaced[0] not in self.tiers[index + 1]:
            if self._store(index + 1, displaced[0], tier.tier, displaced[1]):  # before its slot is overwritten
                self.stats.blocks_demoted += 1
        self._emit(TierMove(int(src_tier), src, int(tier.tier), slot, key))
        return True

    # ---- prefix hits

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of these hashes, from the first, some tier holds."""
        n = 0
        for key in hashes:
            if not any(key in t for t in self.tiers):
                break
            n += 1
        return n

    @contextlib.contextmanager
    def protecting(self, keys: Iterable[BlockHash]) -> Iterator[None]:
        """While device blocks are taken for these hashes' loads, evictions they cause displace none of them."""
        self._protected = set(keys)
        try:
            yield
        finally:
            self._protected = set()

    def load(self, key: BlockHash, device_block: int) -> None:
        """Bring `key`'s block back into `device_block` from the fastest tier that holds it."""
        tier = next(t for t in self.tiers if key in t)
        slot = tier.slot_of(key)
        assert slot is not None
        tier.touch(key)
        self._emit(TierMove(int(tier.tier), slot, int(Tier.DEVICE), device_block, key))
        if tier.tier is Tier.RAM:
            self.stats.hits_ram += 1
        else:
            self.stats.hits_disk += 1

    def forget_failed(self, keys: Iterable[BlockHash]) -> None:
        """Loads the workers could not do: those blocks are not offered again (they are recomputed)."""
        for key in keys:
            self.stats.failed_loads += 1
            self._forget(key)

    def drop_failed_stores(self, keys: Sequence[BlockHash]) -> None:
        """Blocks a worker could not write to its disk: they are not offered again, and the disk tier is turned off
        for good (a full or failing disk would refuse the next writes too; a tier is a cache, so only hits are
        lost). The RAM tier and the device prefix cache go on."""
        self.stats.failed_stores += len(keys)
        for key in keys:
            self._forget(key)
        if self.disk_slots:
            logger.error(
                "the disk KV tier could not store %d block(s) (a full or failing disk): it is off from now on; "
                "free space (or lower --kv-offload-disk-size) and restart the server to have it back",
                len(keys),
            )
            self.disk_slots = self.stats.disk_blocks_total = 0
            self.tiers = [t for t in self.tiers if t.tier is not Tier.DISK]
            if self.events is not None:
                self.events.cleared(Tier.DISK)

    def _forget(self, key: BlockHash) -> None:
        for tier in self.tiers:
            if key in tier:
                tier.forget(key)
                if self.events is not None:
                    self.events.removed(tier.tier, key)

    def take_moves(self) -> list[TierMove]:
        moves, self._moves = self._moves, []
        return moves

    def observe(self, result: StepResult) -> None:
        """A step's measured time moving tier blocks and loading them back (the workers' report)."""
        if result.tier_ms > 0:
            self.stats.move_ms += result.tier_ms
            self.stats.move_steps += 1
        if result.tier_load_ms > 0:
            self.stats.load_ms += result.tier_load_ms
            self.stats.load_step_ms += result.execute_ms
            self.stats.load_steps += 1

    def snapshot(self) -> KVTierStats:
        used = {t.tier: t.num_used for t in self.tiers}
        self.stats.ram_blocks_used = used.get(Tier.RAM, 0)
        self.stats.disk_blocks_used = used.get(Tier.DISK, 0)
        return KVTierStats(**{f: getattr(self.stats, f) for f in KVTierStats.__slots__})  # type: ignore[attr-defined]

    def check_invariants(self) -> None:
        """Raise AssertionError when a tier's slots and its policy disagree (tests and debugging)."""
        for t in self.tiers:
            slots = list(t._slot_of.values())
            if len(set(slots)) != len(slots) or sorted(slots + t._free) != list(range(t.num_slots)):
                raise AssertionError(f"{t.tier.name} tier slots leaked or double-booked")
            if len(t.policy) != len(slots) or any(k not in t.policy for k in t._slot_of):
                raise AssertionError(f"{t.tier.name} tier policy and slots disagree")

    def _emit(self, move: TierMove) -> None:
        self._moves.append(move)
        self.stats.bytes_moved += self.bytes_per_block
