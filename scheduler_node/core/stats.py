"""A snapshot of the scheduler's memory and queues, for Control.GetStats and the metrics endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.memory_stats import DEVICE, DISK, RAM, SWAP, KvPool
from proto.transport import WorldCapacity
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.core.speculative import SpecCounters


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    total_blocks: int
    usable_blocks: int
    used_blocks: int
    free_blocks: int
    cached_free_blocks: int
    kv_usage: float
    fragmentation: float  # 1 - tokens stored / slots held
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    preemptions_recompute: int
    preemptions_swap: int
    swap_blocks_used: int
    swap_blocks_total: int
    num_running: int
    num_waiting: int
    block_size: int
    max_model_len: int
    mean_worker_idle_ms: float  # between consecutive steps, as the workers measured it
    interrupted_steps: int  # skipped for a request that outranked every request in them
    # Live migration: sequences resumed here by KV import or by recompute, and the KV positions imported.
    migrations_imported: int = 0
    migrations_recomputed: int = 0
    migration_kv_tokens_imported: int = 0
    # Speculative decoding (core/speculative.py SpecCounters), vLLM's names; zero when it is off.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


def tokens_stored(s: Scheduler) -> int:
    """Tokens whose KV sits in device blocks, each shared block counted once."""
    bs = s.blocks.block_size
    fill: dict[int, int] = {}
    for req in s.requests.values():
        for i, block in enumerate(s.blocks.blocks_of(req.req_id)):
            fill[block] = max(fill.get(block, 0), min(bs, max(0, req.num_computed_tokens - i * bs)))
    return sum(fill.values())


def snapshot(s: Scheduler) -> SchedulerStats:
    bt, c = s.blocks, s.counters
    spec = s.speculator.counters if s.speculator is not None else SpecCounters()  # zeros when speculation is off
    slots = bt.num_used * bt.block_size
    return SchedulerStats(
        total_blocks=bt.num_blocks,
        usable_blocks=bt.usable_blocks,
        used_blocks=bt.num_used,
        free_blocks=bt.num_free,
        cached_free_blocks=bt.num_cached_free,
        kv_usage=bt.usage,
        fragmentation=1 - tokens_stored(s) / slots if slots else 0.0,
        prefix_cache_queries=c.prefix_cache_queries,
        prefix_cache_hits=c.prefix_cache_hits,
        prefix_cache_hit_rate=c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries else 0.0,
        preemptions_recompute=c.preemptions_recompute,
        preemptions_swap=c.preemptions_swap,
        swap_blocks_used=bt.num_host_used,
        swap_blocks_total=bt.num_host_blocks,
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        block_size=bt.block_size,
        max_model_len=s.max_model_len,
        mean_worker_idle_ms=c.worker_idle_ms / c.steps if c.steps else 0.0,
        interrupted_steps=c.interrupted_steps,
        migrations_imported=c.migrations_imported,
        migrations_recomputed=c.migrations_recomputed,
        migration_kv_tokens_imported=c.migration_kv_tokens_imported,
        spec_decode_num_drafts=spec.num_drafts,
        spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_pos),
    )


def kv_pools(s: Scheduler, capacity: WorldCapacity) -> list[KvPool]:
    """The KV memory in bytes: the workers' device cache (every block they allocated, also beyond a ResizeCache
    limit), its compact pool when there is one (per-request KV precision), the swap space and the offload tiers
    that are on. Everything but the compact pool is in the world's full format; the device tier's prefix hits
    (both pools') are counted on its full pool."""
    bt = s.blocks
    kv_format = capacity.kv_format or "unknown"
    per_block = capacity.world_bytes_per_block or capacity.bytes_per_block
    pools = [
        KvPool(DEVICE, kv_format, per_block, bt.num_blocks, bt.num_used, s.counters.prefix_cache_hits),
        KvPool(SWAP, kv_format, per_block, bt.num_host_blocks, bt.num_host_used),
    ]
    if bt.num_compact_blocks:
        compact_format = capacity.compact_format or "unknown"
        compact_bytes = capacity.compact_world_bytes_per_block
        pools.insert(1, KvPool(DEVICE, compact_format, compact_bytes, bt.num_compact_blocks, bt.num_compact_used))
    if s.tiers is not None:  # hits: the prompt tokens of the blocks loaded back instead of recomputed
        t = s.tiers.snapshot()
        for tier, total, used, hits in ((RAM, t.ram_blocks_total, t.ram_blocks_used, t.hits_ram),
                                        (DISK, t.disk_blocks_total, t.disk_blocks_used, t.hits_disk)):  # fmt: skip
            if total:
                pools.append(KvPool(tier, kv_format, per_block, total, used, hits * bt.block_size))
    return pools


def hit_rates(pools: list[KvPool], queries: int) -> list[tuple[str, float]]:
    """(tier, prompt tokens found in it / prompt tokens looked up) for every tier that caches prefixes."""
    hits: dict[str, int] = {}
    for p in pools:
        if p.tier != SWAP:  # swap holds preempted requests' blocks, never looked up by a new request
            hits[p.tier] = hits.get(p.tier, 0) + p.hits
    return [(tier, n / queries if queries else 0.0) for tier, n in hits.items()]
