"""MemoryMonitor: the KV cache's state as the article prints it, `MemoryMonitor(engine).get_stats()` ->
`{"allocated": 12.3, "fragmentation": 0.15, "free_blocks": 42, ...}`, for an `LLM` or an `AsyncLLMEngine`.

The figures are the ones the servers export (scheduler_node/core/stats.py, the `minivllm:kv_fragmentation` and
`minivllm:cache_hit_rate` metrics), read on the engine's thread, where the scheduler changes them."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from proto.memory_stats import DEVICE, KvPool
from scheduler_node.core.stats import hit_rates, snapshot
from scheduler_node.engine.core import EngineCore

T = TypeVar("T")
GB = 10**9  # the article's unit, as "20GB" is read (settings/worker.py parse_size)
READ_TIMEOUT_S = 30.0  # the engine answers between two steps


class RunsAnEngine(Protocol):
    """An `LLM` or an `AsyncLLMEngine`: it runs a callable on its engine's thread."""

    def on_engine(self, call: Callable[[EngineCore], T]) -> Future[T]: ...


class MemoryMonitor:
    def __init__(self, engine: RunsAnEngine) -> None:
        if not callable(getattr(engine, "on_engine", None)):
            raise TypeError(f"engine: must be a minivllm.LLM or AsyncLLMEngine, got {type(engine).__name__}")
        self.engine = engine

    def get_stats(self) -> dict[str, Any]:
        """The KV cache now. `allocated`: GB of device KV held by requests' blocks; `capacity`: GB of the device
        KV cache; `fragmentation`: 1 - tokens stored / token slots of the blocks held (0..1); `free_blocks`,
        `used_blocks`, `total_blocks`, `cached_blocks` (free, but holding a prefix a later request may reuse);
        `kv_usage` (0..1); `cache_hit_rate`: prompt tokens found in the prefix cache or an offload tier / prompt
        tokens looked up, and `tier_hit_rates` per tier (device, ram, disk); `num_running`, `num_waiting`.
        Waits for the engine's step in progress (seconds at most)."""
        return self.engine.on_engine(kv_stats).result(READ_TIMEOUT_S)


def kv_stats(engine: EngineCore) -> dict[str, Any]:
    """The stats of `MemoryMonitor.get_stats`, on the engine's thread."""
    s = snapshot(engine.scheduler)
    pools: list[KvPool] = engine.kv_pools()
    rates = dict(hit_rates(pools, s.prefix_cache_queries))
    device = [p for p in pools if p.tier == DEVICE]
    return {
        "allocated": sum(p.used_bytes for p in device) / GB,
        "fragmentation": s.fragmentation,
        "free_blocks": s.free_blocks,
        "used_blocks": s.used_blocks,
        "total_blocks": s.total_blocks,
        "cached_blocks": s.cached_free_blocks,
        "capacity": sum(p.allocated_bytes for p in device) / GB,
        "kv_usage": s.kv_usage,
        "cache_hit_rate": sum(rates.values()),
        "tier_hit_rates": rates,
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
    }
