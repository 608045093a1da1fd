"""The interface the engine core drives its workers through, whatever carries the plans.

Two transports implement it: ZeroMQ to worker processes (`scheduler_node/engine/worker_link.py`) and workers in
the same process (`worker_node/inprocess.py`, for the offline API, tests and benchmarks). The engine core knows
only this interface, so the scheduler side stays free of torch while every door runs the same loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from proto.wire import Assignment, StepPlan, StepResult, WorkerReady


class WorkerLost(RuntimeError):
    """A rank disconnected, stopped answering or overran its step deadline; the KV it held is gone."""


class StepFailed(RuntimeError):
    """A rank could not execute a plan (it answered StepError); it keeps running. `handles`: the requests the
    rank blamed (StepError.handles), empty when it could not tell; `adapters`: the LoRA adapters it cannot use."""

    def __init__(self, message: str, handles: tuple[int, ...] = (), adapters: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.handles = handles
        self.adapters = adapters


@dataclass(frozen=True, slots=True)
class WorldCapacity:
    """What the assembled world holds, the same on every rank: the scheduler's block table is sized from it."""

    num_kv_blocks: int
    num_swap_blocks: int
    bytes_per_block: int  # of one device block on one rank (what swapping it moves)
    swap_bytes_per_s: float  # the slowest rank's measured device <-> host bandwidth (0: unknown)
    world_bytes_per_block: int = 0  # of one device block summed over every rank (memory stats)
    kv_format: str = ""  # what the KV is stored as (kernels/kv_quant.py: format_name); "" when nobody said

    ram_tier_blocks: int = 0  # KV offload tiers: slots every rank holds
    disk_tier_blocks: int = 0
    disk_tier_entries: tuple[tuple[int, bytes], ...] = ()  # (slot, hash) intact on every rank's disk at start

    num_compact_blocks: int = 0  # the compact pool every rank holds (per-request KV precision); 0: none
    compact_world_bytes_per_block: int = 0  # of one compact block summed over every rank
    compact_format: str = ""
    kv_addresses: tuple[str, ...] = ()  # each rank's KV exporter (disaggregated prefill); () when none serves

    @classmethod
    def of(cls, readies: list[WorkerReady]) -> WorldCapacity:
        """The world's capacity from every rank's Ready: what the smallest rank holds, one block's bytes on the
        largest rank and over the world, the slowest swap."""
        return cls(
            num_kv_blocks=min(r.num_kv_blocks for r in readies),
            num_swap_blocks=min(r.num_host_blocks for r in readies),
            bytes_per_block=max(r.kv_cache_bytes // max(r.num_kv_blocks, 1) for r in readies),
            swap_bytes_per_s=min(r.swap_bytes_per_s for r in readies),
            world_bytes_per_block=sum(r.kv_cache_bytes // max(r.num_kv_blocks, 1) for r in readies),
            kv_format=readies[0].kv_format,
            **_tier_capacity(readies),
            **_compact_capacity(readies),
            kv_addresses=_kv_addresses(readies),
        )


def _kv_addresses(readies: list[WorkerReady]) -> tuple[str, ...]:
    """Each rank's KV exporter, by rank, when every rank serves one."""
    ranked = sorted(readies, key=lambda r: r.rank)
    return tuple(r.kv_address for r in ranked) if all(r.kv_address for r in ranked) else ()


def _tier_capacity(readies: list[WorkerReady]) -> dict[str, Any]:
    """The KV offload tiers every rank holds: the smallest slot counts, and the disk blocks every rank found
    intact in the same slot (each rank keeps its own shard of a block: a block is whole only if all have it)."""
    common = set(readies[0].disk_tier_blocks).intersection(*(r.disk_tier_blocks for r in readies[1:]))
    return {
        "ram_tier_blocks": min(r.num_ram_tier_blocks for r in readies),
        "disk_tier_blocks": min(r.num_disk_tier_blocks for r in readies),
        "disk_tier_entries": tuple(sorted(common)),
    }


def _compact_capacity(readies: list[WorkerReady]) -> dict[str, Any]:
    """The compact KV pool every rank holds: the smallest block count, and one block's bytes over the world."""
    if not all(r.num_compact_blocks for r in readies):
        return {}
    return {
        "num_compact_blocks": min(r.num_compact_blocks for r in readies),
        "compact_world_bytes_per_block": sum(r.compact_cache_bytes // r.num_compact_blocks for r in readies),
        "compact_format": readies[0].compact_format,
    }


class WorkerTransport(Protocol):
    """Plans out to every rank, the output rank's results back, in the order the plans were sent."""

    lost: asyncio.Event  # set while a rank is lost, cleared once every rank is ready again
    changed: asyncio.Event  # set on every change of a rank's state (health reporting clears it)

    @property
    def all_ready(self) -> bool: ...

    @property
    def lost_reason(self) -> str: ...

    @property
    def capacity(self) -> WorldCapacity: ...

    @property
    def num_ready(self) -> int: ...

    async def start(self, assignment: Callable[[int], Assignment], timeout: float) -> WorldCapacity:
        """Assemble the world (each rank gets `assignment(rank)`); its capacity, or TimeoutError naming who is
        missing. A later replacement of a lost rank is told to hold exactly this capacity."""
        ...

    def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        """Send the plan to every rank. The future completes with the output rank's result once every rank
        answered, or fails with WorkerLost or StepFailed. Raises WorkerLost when a rank is not ready."""
        ...

    def interrupt(self, first_step_id: int, last_step_id: int) -> bool:
        """Ask the workers to skip the compute of these plans in flight; False when this world cannot."""
        ...

    def declare_lost(self, reason: str) -> None:
        """Treat the ranks that owe an answer as lost (a step overran its deadline): the normal recovery follows."""
        ...

    async def wait_ready(self, timeout: float | None) -> bool:
        """Wait until every rank is ready; False when `timeout` seconds passed first (None: no limit)."""
        ...

    async def close(self, reason: str) -> None: ...
