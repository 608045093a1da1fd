"""The prefix cache's changes as events: which block hashes a replica holds, in which tier (KV-aware routing).

Every place a block hash enters or leaves the prefix cache reports it here, and nowhere else: the block table
when it registers a computed block or forgets one (eviction, reuse, resize, a failed load), and the offload tiers
when they store, displace or forget a block. The sink mirrors what each tier holds, so its events are exact (a
hash stored twice, say in the full and the compact pool, is one event; it is removed when the last copy goes) and
a snapshot is the mirror itself. The engine publishes the pending events once per step
(scheduler_node/engine/kv_publisher.py); the router's `kv` strategy keeps an index of them
(router_node/kv_index.py). No sockets here: the scheduler core stays pure.
"""

from __future__ import annotations

from proto.kv_events import CLEARED, DEVICE, DISK, RAM, REMOVED, STORED, TIERS, Event

__all__ = ["CLEARED", "DEVICE", "DISK", "RAM", "REMOVED", "STORED", "Event", "KVEventSink"]


class KVEventSink:
    """The changes since the last `take()`, and what each tier holds now."""

    def __init__(self) -> None:
        self.pending: list[Event] = []
        self.held: dict[int, set[bytes]] = {tier: set() for tier in TIERS}

    def stored(self, tier: int, block_hash: bytes, parent: bytes | None = None) -> None:
        held = self.held[tier]
        if block_hash not in held:
            held.add(block_hash)
            self.pending.append((STORED, int(tier), block_hash, parent))

    def removed(self, tier: int, block_hash: bytes) -> None:
        held = self.held[tier]
        if block_hash in held:
            held.discard(block_hash)
            self.pending.append((REMOVED, int(tier), block_hash, None))

    def cleared(self, tier: int) -> None:
        """Everything of `tier` is gone (a new block table after a lost rank, the tiers cleared or turned off)."""
        if self.held[tier]:
            self.held[tier] = set()
            self.pending.append((CLEARED, int(tier), None, None))

    def take(self) -> list[Event]:
        events, self.pending = self.pending, []
        return events

    def snapshot(self) -> list[tuple[int, bytes]]:
        """Every (tier, hash) held now; only consistent with the events once the pending ones were taken."""
        return [(tier, h) for tier, held in self.held.items() for h in held]

    def __len__(self) -> int:
        return sum(len(held) for held in self.held.values())
