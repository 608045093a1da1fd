"""The scheduler's counters: what it did since start, read by stats and metrics (core/stats.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    compaction_moves: int = 0
    compaction_seconds: float = 0.0
    steps: int = 0
    worker_idle_ms: float = 0.0  # summed over steps: the gap the workers waited between steps
    interrupted_steps: int = 0  # steps whose compute was skipped for a request that outranked them
    scheduled_tokens: int = 0  # tokens computed by the workers, recomputation included
    # Live migration: sequences resumed here from another replica, by KV import or by recompute, and the positions
    # whose KV they planned to import (a pull that fails later is recomputed: core/migrations_in.py).
    migrations_imported: int = 0
    migrations_recomputed: int = 0
    migration_kv_tokens_imported: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap
