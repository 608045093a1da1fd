"""Which LoRA adapter sits in which of the workers' `--max-loras` slots, decided here so every rank agrees.

A slot is pinned while a request the workers hold runs with its adapter; an unpinned slot keeps its adapter
(a later request reuses it without a reload) until the least recently used unpinned slot is taken for another
adapter. A request whose adapter has no slot and finds none free waits; requests that need no new slot pass it.

The host tier (--max-cpu-loras): an adapter evicted from a slot stays in the workers' host memory, up to that many,
least recently evicted out first; taking it back into a slot moves it out of the host tier (the tiers hold each
adapter once). The workers keep the same tier by the same rule (worker_node/lora/manager.py); it is mirrored here
for the memory stats.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from proto.wire import LoraAdapter


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A registered adapter: `id` is never reused for other weights (the workers key their slots by it)."""

    name: str
    id: int
    path: str
    # Its files' checksum when registered (proto/lora.py AdapterFiles.sha256): the workers check that they read the
    # same bytes, and it seeds its requests' prefix-cache hashes, so blocks are shared only by the same content (a
    # changed file under the same path, after a restart: the disk tier, is another adapter).
    sha256: str = ""
    nbytes: int = 0  # its tensors' bytes as its file stores them (the memory stats)

    @property
    def cache_salt(self) -> str:
        return f"\x00lora:{self.sha256 or self.id}"


class _HasLora(Protocol):
    @property
    def lora(self) -> LoraRef | None: ...


def lora_requests(running: Iterable[_HasLora], waiting: Iterable[_HasLora]) -> dict[tuple[str, ...], float]:
    """(adapter name, state) -> requests, for the metrics."""
    counts: Counter[tuple[str, ...]] = Counter()
    for state, requests in (("running", running), ("waiting", waiting)):
        counts.update((r.lora.name, state) for r in requests if r.lora is not None)
    return {key: float(n) for key, n in counts.items()}


@dataclass(frozen=True, slots=True)
class LoraMemory:
    """The adapters one tier holds: how many, out of how many places, and their bytes."""

    tier: str  # device (the --max-loras slots) or host (--max-cpu-loras)
    adapters: int
    capacity: int
    bytes: int


class LoraSlots:
    def __init__(self, num_slots: int, host_slots: int = 0) -> None:
        self.num_slots = num_slots
        self.host_slots = host_slots
        self._host: OrderedDict[int, int] = OrderedDict()  # adapter id -> bytes, least recently evicted first
        self._bytes: dict[int, int] = {}  # adapter id in a slot -> its bytes
        self._holder: list[int | None] = [None] * num_slots  # slot -> adapter id in it
        self._pins: list[int] = [0] * num_slots  # slot -> held requests using it
        self._used: list[int] = [0] * num_slots  # slot -> when it was last pinned (LRU)
        self._clock = itertools.count(1)

    def _slot_of(self, lora_id: int) -> int | None:
        try:
            return self._holder.index(lora_id)
        except ValueError:
            return None

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used unpinned one."""
        idle = [s for s in range(self.num_slots) if not self._pins[s]]
        if not idle:
            return None
        empty = [s for s in idle if self._holder[s] is None]
        return empty[0] if empty else min(idle, key=lambda s: self._used[s])

    def fits(self, lora: LoraRef) -> bool:
        """Could a request with this adapter start now?"""
        return self._slot_of(lora.id) is not None or self._free_slot() is not None

    def pin(self, lora: LoraRef) -> LoraAdapter:
        """A slot for a request the workers are about to hold (checked with `fits` first)."""
        slot = self._slot_of(lora.id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise RuntimeError(f"LoRA adapter {lora.name}: no free slot (admission checks fits first)")
            self._host.pop(lora.id, None)  # out of the host tier first: the evicted one must not push it out
            self._evict(slot)
            self._holder[slot], self._bytes[lora.id] = lora.id, lora.nbytes
        self._pins[slot] += 1
        self._used[slot] = next(self._clock)
        return LoraAdapter(lora.id, lora.path, slot, self.host_slots, lora.name, lora.sha256)

    def _evict(self, slot: int) -> None:
        """The slot's adapter goes to the host tier (its oldest one out when full)."""
        held = self._holder[slot]
        if held is None:
            return
        nbytes = self._bytes.pop(held, 0)
        if self.host_slots:
            self._host[held] = nbytes
            while len(self._host) > self.host_slots:
                self._host.popitem(last=False)

    def unpin(self, lora: LoraRef) -> None:
        slot = self._slot_of(lora.id)
        if slot is not None and self._pins[slot]:
            self._pins[slot] -= 1

    def unpin_all(self) -> None:
        """The workers hold no request any more (they dropped or lost them all)."""
        self._pins = [0] * self.num_slots

    @property
    def pinned(self) -> int:
        return sum(1 for p in self._pins if p)

    def memory(self) -> list[LoraMemory]:
        """The adapters in the slots and in the host tier, with their bytes."""
        device = [a for a in self._holder if a is not None]
        tiers = [LoraMemory("device", len(device), self.num_slots, sum(self._bytes[a] for a in device))]
        if self.host_slots:
            tiers.append(LoraMemory("host", len(self._host), self.host_slots, sum(self._host.values())))
        return tiers

    def in_host(self) -> list[int]:
        """The adapter ids in the host tier, the next one out first."""
        return list(self._host)

    def resident(self) -> dict[int, int]:
        """Adapter id -> the requests the workers hold with it (0: resident but idle)."""
        return {a: p for a, p in zip(self._holder, self._pins) if a is not None}
