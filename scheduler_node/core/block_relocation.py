"""Moving live full blocks to other ids in the block table (core/block_table.py): resizing the usable pool
(ResizeCache: the live blocks above a smaller limit move below it) and compaction (the highest live blocks move
into the lowest free ones, so a later shrink has less to move).

A move is a device copy the workers do before the step's forward pass (`BlockOps.copy`); the block keeps its ref
count and its prefix-cache hash, and every request's table points at the new id. The answer, per request, is the
(index, block) replacements, which the scheduler passes on to its view of the workers. Compact blocks never move.
These functions are a part of BlockTable in a file of their own: they work on its bookkeeping (free list, ref
counts, hashes) directly, as its methods would.
"""

from __future__ import annotations

from scheduler_node.core.block_table import BlockTable

Moves = dict[str, list[tuple[int, int]]]  # per request: (index in its table, new block)


def resize(table: BlockTable, usable: int) -> Moves:
    """Set the usable block count; live blocks at or above it move below (device copies).

    Returns, per request, the (index, block) replacements. Raises MemoryError when the live blocks do
    not fit under the new limit."""
    if not 1 <= usable <= table.num_blocks:
        raise ValueError(f"usable blocks must be in [1, {table.num_blocks}], got {usable}")
    live_above = [b for b in range(usable, table.usable_blocks) if table._ref_counts[b] > 0]
    free_below = sum(1 for b in table._free if b < usable)
    if len(live_above) > free_below:
        raise MemoryError(f"{table.num_used} live blocks do not fit in {usable}")
    for b in range(usable, table.usable_blocks):  # drop the free ones above the limit
        if b in table._free:
            del table._free[b]
            table._evict(b)
    for b in range(table.usable_blocks, usable):  # or bring blocks back
        table._free[b] = None
    table.usable_blocks = usable
    return _relocate(table, live_above)


def compact(table: BlockTable, max_moves: int) -> Moves:
    """Move up to `max_moves` of the highest live blocks into the lowest free ones below them."""
    free_low = sorted(table._free)
    moves: list[int] = []
    for block in range(table.usable_blocks - 1, -1, -1):
        if len(moves) == max_moves or not free_low or free_low[0] > block:
            break
        if table._ref_counts[block] > 0:
            moves.append(block)
            free_low.pop(0)
    return _relocate(table, moves)


def _relocate(table: BlockTable, blocks: list[int]) -> Moves:
    if not blocks:
        return {}
    moving = set(blocks)
    lowest_free = sorted(b for b in table._free)
    target = {}
    for block in sorted(moving):
        dst = lowest_free.pop(0)
        del table._free[dst]
        table._evict(dst)  # its cached content is overwritten
        target[block] = dst
        table.ops.copy.append((block, dst))
        table._ref_counts[dst], table._ref_counts[block] = table._ref_counts[block], 0
        h = table._hash_of[block]
        if h is not None:
            table._hash_of[dst], table._hash_of[block] = h, None
            table._cached[h] = dst
        if block < table.usable_blocks:
            table._free[block] = None
    updates: Moves = {}
    for req_id, blocks_of_req in table._tables.items():
        for i, block in enumerate(blocks_of_req):
            if block in target:
                blocks_of_req[i] = target[block]
                updates.setdefault(req_id, []).append((i, target[block]))
    return updates
