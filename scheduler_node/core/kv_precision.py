"""Per-request KV precision (seed 000's memory-sensitive mode): which block format holds a request's KV.

An engine may keep two device pools: `full` blocks (the model's dtype, or what --kv-cache-dtype says) and
`compact` blocks (--kv-compact-dtype: int8 or fp8 e4m3 with per-token scales, about half a bf16 block). Both live
in one block-id space: ids [0, F) are full, [F, F + C) compact (core/block_table.py), so a request's block ids
say which pool they address; the plan carries F once (`StepPlan.compact_block_base`), since the world's F is known
only once every worker has sized its pools.

A request asks for `auto`, `full` or `compact` (`kv_precision`). `full` and `compact` always get what they ask
(a `compact` request on an engine without a compact pool, or longer than it, is refused at submission). `auto` gets
full blocks, except under --kv-compact-under-pressure when the full pool is *tight*: its free blocks, once the
request took what it needs, would be fewer than `tight_fraction` of its usable blocks. Then an `auto` request whose
static priority is below `full_priority` gets compact blocks when the compact pool has room for it now and could
hold it whole (else it would be preempted there, come back compact, and again); one at or above keeps full
precision. The choice is made each time a request starts from nothing (admission, or resumption after
a recompute preemption); a request's blocks always share one format.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class BlockFormat(enum.IntEnum):
    """The pool a block belongs to."""

    FULL = 0
    COMPACT = 1


KV_PRECISIONS = ("auto", "full", "compact")
COMPACT_DTYPES = ("int8", "fp8_e4m3")


DEFAULT_COMPACT_FRACTION = 0.5  # of the KV memory, under --kv-compact-under-pressure without a fraction


@dataclass(frozen=True, slots=True)
class CompactKV:
    """The compact pool and the memory-sensitive mode (vllm-scheduler's --kv-compact-* flags)."""

    fraction: float = 0.0  # share of each worker's KV memory that holds compact blocks (0: no compact pool)
    dtype: str = "int8"  # the compact blocks' format: int8 or fp8_e4m3 (kernels/kv_quant.py)
    under_pressure: bool = False  # auto requests may get compact blocks when the full pool is tight
    tight_fraction: float = 0.25  # the full pool is tight below this share of free usable blocks
    full_priority: int = 80  # auto requests of this static priority or more keep full blocks (realtime: 80-100)

    def __post_init__(self) -> None:
        if not 0 <= self.fraction < 1:
            raise ValueError(f"kv_compact_fraction must be in [0, 1), got {self.fraction}")
        if self.dtype not in COMPACT_DTYPES:
            raise ValueError(f"kv_compact_dtype must be one of {', '.join(COMPACT_DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.tight_fraction <= 1:
            raise ValueError(f"kv_compact_tight_fraction must be in [0, 1], got {self.tight_fraction}")
        if self.under_pressure and self.fraction == 0:
            raise ValueError("kv_compact_under_pressure needs a compact pool: kv_compact_fraction > 0")

    @classmethod
    def from_flags(cls, under_pressure: bool, fraction: float | None, **settings: Any) -> CompactKV:
        """The flags' settings (`settings`: dtype, tight_fraction, full_priority; those left out keep the defaults
        above). An unset fraction is DEFAULT_COMPACT_FRACTION under the memory-sensitive mode, else 0 (no pool)."""
        if fraction is None:
            fraction = DEFAULT_COMPACT_FRACTION if under_pressure else 0.0
        return cls(fraction, under_pressure=under_pressure, **settings)


def choose_format(
    precision: str,
    priority: int,
    config: CompactKV,
    has_compact_pool: bool,
    fits: Callable[[BlockFormat], int],
    usable_full: int,
) -> BlockFormat:
    """The format of a request starting from nothing. `fits(format)` is how many free blocks of that format would
    be left once the request took what it needs (negative: it does not fit)."""
    if precision == "compact":
        return BlockFormat.COMPACT
    if precision == "full" or not (config.under_pressure and has_compact_pool):
        return BlockFormat.FULL
    if priority >= config.full_priority:
        return BlockFormat.FULL
    tight = fits(BlockFormat.FULL) < config.tight_fraction * usable_full
    if tight and fits(BlockFormat.COMPACT) >= 0:
        return BlockFormat.COMPACT
    return BlockFormat.FULL
