"""Replacement policies of the KV offload tiers: which resident block hash makes room for a new one.

Both skip `protected` keys (blocks being loaded back this step) and say when nothing can make room.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler_node.core.kv.block_ops import BlockHash
from settings.scheduler import KV_OFFLOAD_POLICIES


def _oldest_unprotected(entries: OrderedDict[BlockHash, None], protected: set[BlockHash]) -> BlockHash | None:
    return next((k for k in entries if k not in protected), None)


class LruPolicy:
    """Least recently used: a hit moves the entry to the back, the victim is the front."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def touch(self, key: BlockHash) -> None:
        self._entries.move_to_end(key)

    def remove(self, key: BlockHash) -> None:
        self._entries.pop(key, None)

    def insert(self, key: BlockHash, protected: set[BlockHash]) -> tuple[bool, BlockHash | None]:
        """Admit `key` (not resident); returns (admitted, the resident it displaced)."""
        victim = None
        if len(self._entries) >= self.capacity:
            victim = _oldest_unprotected(self._entries, protected)
            if victim is None:
                return False, None
            del self._entries[victim]
        self._entries[key] = None
        return True, victim


class ArcPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    T1 holds entries seen once recently, T2 entries seen at least twice; B1 and B2 remember the keys lately
    evicted from each (no data). A miss that finds its key in B1 says recency was undervalued and grows T1's
    target share `p`; one in B2 shrinks it. The victim comes from T1 while T1 is over its target, else from T2.
    A scan of one-time blocks therefore cannot flush the prefixes that keep coming back."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0  # target size of T1
        self.t1: OrderedDict[BlockHash, None] = OrderedDict()
        self.t2: OrderedDict[BlockHash, None] = OrderedDict()
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def touch(self, key: BlockHash) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def remove(self, key: BlockHash) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def insert(self, key: BlockHash, protected: set[BlockHash]) -> tuple[bool, BlockHash | None]:
        c = self.capacity
        in_b1, in_b2 = key in self.b1, key in self.b2
        if in_b1:
            self.p = min(c, self.p + max(len(self.b2) // len(self.b1), 1))
        elif in_b2:
            self.p = max(0, self.p - max(len(self.b1) // len(self.b2), 1))
        elif len(self.t1) + len(self.b1) >= c and self.b1:
            self.b1.popitem(last=False)  # L1 (T1 + B1) is kept within c
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
            self.b2.popitem(last=False)  # the whole directory within 2c
        victim = None
        if len(self) >= c:
            victim = self._replace(in_b2, protected)
            if victim is None:
                return False, None
        if in_b1 or in_b2:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None  # seen before: frequent
        else:
            self.t1[key] = None
        return True, victim

    def _replace(self, key_in_b2: bool, protected: set[BlockHash]) -> BlockHash | None:
        prefer_t1 = bool(self.t1) and (len(self.t1) > self.p or (key_in_b2 and len(self.t1) == self.p))
        order = ((self.t1, self.b1), (self.t2, self.b2)) if prefer_t1 else ((self.t2, self.b2), (self.t1, self.b1))
        for resident, ghosts in order:
            victim = _oldest_unprotected(resident, protected)
            if victim is not None:
                del resident[victim]
                ghosts[victim] = None
                return victim
        return None


Policy = LruPolicy | ArcPolicy


def make_tier_policy(name: str, capacity: int) -> Policy:
    if name == "arc":
        return ArcPolicy(capacity)
    if name == "lru":
        return LruPolicy(capacity)
    raise ValueError(f"kv_offload_policy must be one of {KV_OFFLOAD_POLICIES}, got {name!r}")
