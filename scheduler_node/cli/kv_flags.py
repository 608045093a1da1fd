"""The KV cache's flags (vllm-scheduler, vllm-serve): prefix caching, what preemption does with a victim's blocks,
the offload tiers' replacement, compaction, and per-request KV precision (scheduler_node/core/kv_precision.py)."""

from __future__ import annotations

import argparse

from scheduler_node.core.config import PREEMPTION_MODES
from scheduler_node.core.kv_precision import COMPACT_DTYPES, CompactKV
from scheduler_node.core.tier_policy import KV_OFFLOAD_POLICIES
from scheduler_node.engine.builder import EngineConfig

_DEFAULTS = EngineConfig()
_SCHEDULER = _DEFAULTS.scheduler


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_SCHEDULER.enable_prefix_caching,
        help="reuse the KV of identical prompt prefixes across requests (--no-enable-prefix-caching: off)",
    )
    p.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default=_SCHEDULER.preemption_mode.value,
        help="when KV runs out: recompute the victim later, swap its blocks to host memory, or elastic "
        "(per victim, whichever is cheaper by measured compute time and swap bandwidth)",
    )
    p.add_argument(
        "--kv-offload-policy",
        choices=KV_OFFLOAD_POLICIES,
        default=_SCHEDULER.kv_offload_policy,
        help="replacement in the workers' KV offload tiers (--kv-offload-ram, --kv-offload-disk): arc (adaptive: "
        "recency and frequency, scan-resistant) or lru",
    )
    p.add_argument(
        "--compaction-interval",
        type=int,
        default=_SCHEDULER.compaction_interval,
        help="every N steps, move live KV blocks into the lowest free ones (0: never). Compaction and "
        "Control.ResizeCache only limit which blocks the scheduler hands out: the workers' KV tensors keep their "
        "size, so a shrink gives no device memory back (docs/guide.md, KV memory)",
    )
    _add_kv_precision_flags(p)


def _add_kv_precision_flags(p: argparse.ArgumentParser) -> None:
    """Per-request KV precision (scheduler_node/core/kv_precision.py): the compact pool and the memory-sensitive
    mode."""
    p.add_argument(
        "--kv-compact-under-pressure",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.kv_compact.under_pressure,
        help="memory-sensitive mode: when the full-precision KV pool is tight (its free blocks, once a request took "
        "its own, below --kv-compact-tight-fraction of it), requests with kv_precision auto below "
        "--kv-compact-full-priority get compact (quantized) blocks; kv_precision full/compact always get theirs",
    )
    p.add_argument(
        "--kv-compact-fraction",
        type=float,
        default=None,
        help="share of each worker's KV memory that holds compact blocks, the rest full ones (default: 0.5 with "
        "--kv-compact-under-pressure, else 0: no compact pool, and kv_precision compact is refused)",
    )
    p.add_argument(
        "--kv-compact-dtype",
        choices=COMPACT_DTYPES,
        default=_DEFAULTS.kv_compact.dtype,
        help="how compact blocks store keys and values (one float32 scale per token and KV head; fp8 with triton "
        "needs compute capability 8.9+)",
    )
    p.add_argument(
        "--kv-compact-tight-fraction",
        type=float,
        default=_DEFAULTS.kv_compact.tight_fraction,
        help="with --kv-compact-under-pressure: the full pool is tight when a request would leave fewer free "
        "blocks than this share of it",
    )
    p.add_argument(
        "--kv-compact-full-priority",
        type=int,
        default=_DEFAULTS.kv_compact.full_priority,
        help="with --kv-compact-under-pressure: auto requests of this priority or more keep full blocks when the "
        "pool is tight (realtime is 80-100, the default 50)",
    )


def compact_kv(args: argparse.Namespace) -> CompactKV:
    """The compact KV pool's settings from the flags (ValueError naming what is out of range)."""
    return CompactKV.from_flags(
        args.kv_compact_under_pressure,
        args.kv_compact_fraction,
        dtype=args.kv_compact_dtype,
        tight_fraction=args.kv_compact_tight_fraction,
        full_priority=args.kv_compact_full_priority,
    )
