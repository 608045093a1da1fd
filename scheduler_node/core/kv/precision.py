"""Per-request KV precision (seed 000's memory-sensitive mode): which block format holds a request's KV.

An engine may keep two device pools: `full` blocks (the model's dtype, or what --kv-cache-dtype says) and `compact`
blocks (--kv-compact-dtype: int8 or fp8 e4m3 with per-token scales, about half a bf16 block; the pool's settings are
settings/kv_compact.py's `CompactKV`). Both live in one block-id space: ids [0, F) are full, [F, F + C) compact
(core/kv/block_table.py), so a request's block ids say which pool they address; the plan carries F once
(`StepPlan.compact_block_base`), since the world's F is known only once every worker has sized its pools.

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

from settings.kv_compact import CompactKV


class BlockFormat(enum.IntEnum):
    """The pool a block belongs to."""

    FULL = 0
    COMPACT = 1


KV_PRECISIONS = ("auto", "full", "compact")


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
