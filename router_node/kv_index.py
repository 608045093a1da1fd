"""The router's exact index of the replicas' prefix caches, built from their KV events (proto/kv_events.py).

`KVIndex` maps each block hash to the replicas that hold it and in which tiers (device, cpu, disk), and answers
how many of a request's leading blocks each replica holds. Per replica, `ReplicaFeed` applies its batches in
order and decides when its part of the index cannot be trusted: before its first snapshot, on a hole in the
sequence numbers (a lost batch), on a new epoch (the replica restarted: its cache is empty, not what we knew),
after a batch it could not read, and while the replica is down or silent. Then the replica's entries are dropped
(it counts as holding nothing) and a snapshot is asked for; batches that arrive meanwhile are kept and those after
the snapshot's sequence number are applied on top of it.

No sockets here (router_node/kv_subscriber.py does the I/O), so the resync rules are unit-tested.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proto.kv_events import CLEARED, REMOVED, STORED, TIERS, KVEventBatch, KVSnapshot

MAX_BUFFERED = 4096  # batches kept while a snapshot is on its way; beyond it the oldest go (and another is asked)


class KVIndex:
    """hash -> {replica: bitmask of tiers}, and each replica's hashes (to drop them at once). Beside them, the
    blocks predicted on a replica (a request routed there will compute them): each counts until its event comes
    (then the event is the truth, and a later removal counts) or its time is up, and all go when the replica's
    entries are dropped (a restart, a hole)."""

    def __init__(self) -> None:
        self.holders: dict[bytes, dict[str, int]] = {}
        self.owned: dict[str, set[bytes]] = {}
        self.predicted: dict[str, dict[bytes, float]] = {}  # replica -> {hash: until}

    def store(self, replica: str, tier: int, h: bytes) -> None:
        held = self.holders.setdefault(h, {})
        held[replica] = held.get(replica, 0) | (1 << tier)
        self.owned.setdefault(replica, set()).add(h)
        self.predicted.get(replica, {}).pop(h, None)

    def predict(self, replica: str, hashes: Iterable[bytes], until: float, now: float) -> None:
        """`replica` will hold `hashes` (those it does not hold yet) once it computed them; count them until then."""
        mine = {h: t for h, t in self.predicted.get(replica, {}).items() if t >= now}
        for h in hashes:
            if replica not in self.holders.get(h, ()):
                mine[h] = until
        self.predicted[replica] = mine

    def remove(self, replica: str, tier: int, h: bytes) -> None:
        held = self.holders.get(h)
        if held is None or replica not in held:
            return
        held[replica] &= ~(1 << tier)
        if not held[replica]:
            self._forget(replica, h, held)

    def clear(self, replica: str, tier: int | None = None) -> None:
        """Drop what `replica` holds in `tier` (every tier, and every prediction, when None)."""
        if tier is None:
            self.predicted.pop(replica, None)
        for h in list(self.owned.get(replica, ())):
            held = self.holders[h]
            held[replica] &= 0 if tier is None else ~(1 << tier)
            if not held[replica]:
                self._forget(replica, h, held)

    def _forget(self, replica: str, h: bytes, held: dict[str, int]) -> None:
        del held[replica]
        if not held:
            del self.holders[h]
        self.owned[replica].discard(h)

    def num_blocks(self, replica: str) -> int:
        return len(self.owned.get(replica, ()))

    def overlap(self, hashes: Sequence[bytes], replicas: Iterable[str], now: float | None = None) -> dict[str, int]:
        """For each replica, how many of `hashes`, from the first, it holds in some tier (or, with `now`, is
        predicted to hold)."""
        counts = dict.fromkeys(replicas, 0)
        alive = set(counts)
        horizon = float("inf") if now is None else now  # a prediction counts while its time is >= now
        predicted = {r: self.predicted.get(r, {}) for r in counts}
        for i, h in enumerate(hashes):
            held = self.holders.get(h, {})
            alive = {r for r in alive if r in held or predicted[r].get(h, float("-inf")) >= horizon}
            if not alive:
                break
            for r in alive:
                counts[r] = i + 1
        return counts


@dataclass(slots=True)
class ReplicaFeed:
    """One replica's events into the index: in order, or not at all."""

    name: str
    index: KVIndex
    epoch: bytes | None = None
    seq: int = 0
    block_size: int = 0
    synced: bool = False  # while False the replica counts as holding nothing, and the subscriber asks a snapshot
    resyncs: int = 0  # times its part of the index was dropped (metrics, tests)
    buffered: list[KVEventBatch] = field(default_factory=list)

    def on_batch(self, batch: KVEventBatch) -> None:
        if not self.synced:
            self._buffer(batch)
        elif batch.epoch != self.epoch:
            self.distrust()  # a restarted replica: nothing we knew of it holds any more
            self._buffer(batch)
        elif batch.seq != self.seq + 1:
            self.distrust()  # a lost batch: some change is unknown
            self._buffer(batch)
        else:
            self._apply(batch)

    def on_snapshot(self, snapshot: KVSnapshot) -> None:
        """The replica's whole cache after batch `snapshot.seq`; the batches buffered since are replayed on it."""
        self.index.clear(self.name)
        for tier, h in snapshot.entries:
            self.index.store(self.name, tier, h)
        self.epoch, self.seq, self.block_size = snapshot.epoch, snapshot.seq, snapshot.block_size
        self.synced = True
        buffered, self.buffered = self.buffered, []
        for batch in buffered:
            if batch.epoch == self.epoch and batch.seq <= self.seq:
                continue  # already in the snapshot
            self.on_batch(batch)
            if not self.synced:
                break  # a hole or another epoch after the snapshot: on_batch asked for a new one

    def distrust(self) -> None:
        """Drop the replica's entries and ask for a snapshot (a hole, a new epoch, a down or silent replica)."""
        if self.synced or self.index.num_blocks(self.name):
            self.resyncs += 1
        self.index.clear(self.name)
        self.synced = False
        self.buffered = []

    def _buffer(self, batch: KVEventBatch) -> None:
        self.buffered.append(batch)
        if len(self.buffered) > MAX_BUFFERED:
            del self.buffered[0]

    def _apply(self, batch: KVEventBatch) -> None:
        self.seq, self.block_size = batch.seq, batch.block_size
        for kind, tier, h, _parent in batch.events:
            if kind == STORED and h is not None:
                self.index.store(self.name, tier, h)
            elif kind == REMOVED and h is not None:
                self.index.remove(self.name, tier, h)
            elif kind == CLEARED:
                self.index.clear(self.name, tier if tier in TIERS else None)
