"""Per-request KV precision's settings: the compact pool and the memory-sensitive mode
(scheduler_node/core/kv/precision.py)."""

from __future__ import annotations

from dataclasses import dataclass

from settings.setting import check, setting

COMPACT_DTYPES = ("int8", "fp8_e4m3")
DEFAULT_COMPACT_FRACTION = 0.5  # of the KV memory, under --kv-compact-under-pressure without a fraction


@dataclass(frozen=True, slots=True)
class CompactKV:
    """Per-request KV precision: the compact pool and the memory-sensitive mode."""

    fraction: float = setting(  # None given: derived in __post_init__
        None,
        name="kv_compact_fraction",
        low=0,
        below=1,
        readers=("scheduler", "worker"),
        help="share of each worker's KV memory that holds compact blocks, the rest full ones (default: 0.5 with "
        "--kv-compact-under-pressure, else 0: no compact pool, and kv_precision compact is refused)",
    )
    dtype: str = setting(
        "int8",
        name="kv_compact_dtype",
        choices=COMPACT_DTYPES,
        readers=("scheduler", "worker"),
        help="how compact blocks store keys and values (one float32 scale per token and KV head; fp8 with triton "
        "needs compute capability 8.9+)",
    )
    under_pressure: bool = setting(
        False,
        name="kv_compact_under_pressure",
        readers="scheduler",
        help="memory-sensitive mode: when the full-precision KV pool is tight (its free blocks, once a request took "
        "its own, below --kv-compact-tight-fraction of it), requests with kv_precision auto below "
        "--kv-compact-full-priority get compact (quantized) blocks; kv_precision full/compact always get theirs",
    )
    tight_fraction: float = setting(
        0.25,
        name="kv_compact_tight_fraction",
        low=0,
        high=1,
        readers="scheduler",
        help="with --kv-compact-under-pressure: the full pool is tight when a request would leave fewer free "
        "blocks than this share of it",
    )
    full_priority: int = setting(
        80,
        name="kv_compact_full_priority",
        readers="scheduler",
        help="with --kv-compact-under-pressure: auto requests of this priority or more keep full blocks when the "
        "pool is tight (realtime is 80-100, the default 50)",
    )

    def __post_init__(self) -> None:
        if self.fraction is None:  # unset: a pool of the default share under the memory-sensitive mode, else none
            object.__setattr__(self, "fraction", DEFAULT_COMPACT_FRACTION if self.under_pressure else 0.0)
        check(self)
        if self.under_pressure and self.fraction == 0:
            raise ValueError("kv_compact_under_pressure needs a compact pool: kv_compact_fraction > 0")
