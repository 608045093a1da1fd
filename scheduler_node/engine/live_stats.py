"""The engine's numbers read at scrape time: KV memory per tier and format, LoRA adapters' memory, and the gauges
and scheduler counters Metrics exports. Read-only; the engine core (engine/core.py) answers the doors' and the
scrape's questions through it."""

from __future__ import annotations

import asyncio

from proto.memory_stats import KvPool
from proto.transport import WorkerTransport
from scheduler_node.core.lora_slots import LoraMemory, lora_requests
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.core.stats import hit_rates, kv_pools, snapshot
from scheduler_node.engine.metrics import LiveSample, Metrics


class LiveStats:
    def __init__(self, scheduler: Scheduler, workers: WorkerTransport, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.metrics = metrics

    def kv_pools(self) -> list[KvPool]:
        """The KV memory in bytes, per tier and format."""
        return kv_pools(self.scheduler, self.workers.capacity)

    def lora_memory(self, lora_on: bool) -> list[LoraMemory]:
        """The LoRA adapters in the workers' slots and host tier (none while LoRA is off)."""
        return self.scheduler.view.lora_slots.memory() if lora_on else []

    def live_metrics(self, lora_on: bool) -> LiveSample:
        """The scrape-time gauges and scheduler counters (Metrics reads them on the event loop's thread)."""
        s = snapshot(self.scheduler)
        pools = self.kv_pools()
        loras = self.lora_memory(lora_on)
        tiers: LiveSample = {}
        if self.scheduler.tiers is not None:
            tiers.update(self.scheduler.tiers.snapshot().as_metrics())
        return tiers | {
            "vllm:num_requests_running": s.num_running,
            "vllm:num_requests_waiting": s.num_waiting,
            "vllm:kv_cache_usage_perc": s.kv_usage,
            "minivllm:kv_fragmentation": s.fragmentation,
            "minivllm:batch_utilization": self.metrics.batch_utilization,
            "minivllm:workers_ready": self.workers.num_ready,
            "minivllm:asyncio_tasks": len(asyncio.all_tasks()),
            "vllm:num_preemptions": s.preemptions_recompute + s.preemptions_swap,
            "vllm:prefix_cache_queries": s.prefix_cache_queries,
            "vllm:prefix_cache_hits": s.prefix_cache_hits,
            "minivllm:migrations_imported": s.migrations_imported,
            "minivllm:migrations_recomputed": s.migrations_recomputed,
            "minivllm:migration_kv_tokens_imported": s.migration_kv_tokens_imported,
            "minivllm:kv_cache_allocated_bytes": {(p.tier, p.format): p.allocated_bytes for p in pools},
            "minivllm:kv_cache_used_bytes": {(p.tier, p.format): p.used_bytes for p in pools},
            "minivllm:cache_hit_rate": {(tier,): rate for tier, rate in hit_rates(pools, s.prefix_cache_queries)},
            "minivllm:lora_requests": lora_requests(self.scheduler.running, self.scheduler.waiting),
            "minivllm:lora_memory_bytes": {(m.tier,): m.bytes for m in loras},
            "minivllm:lora_adapters_resident": {(m.tier,): m.adapters for m in loras},
            "vllm:spec_decode_num_drafts": s.spec_decode_num_drafts,
            "vllm:spec_decode_num_draft_tokens": s.spec_decode_num_draft_tokens,
            "vllm:spec_decode_num_accepted_tokens": s.spec_decode_num_accepted_tokens,
            "vllm:spec_decode_num_accepted_tokens_per_pos": {
                (str(i),): n for i, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos)
            },
        }
