"""Moving live full blocks to other ids in the block table (core/kv/block_table.py): resizing the usable pool
(ResizeCache: the live blocks above a smaller limit move below it) and compaction (the highest live blocks move
into the lowest free ones, so a later shrink has less to move).

A move is a device copy the workers do before the step's forward pass (`BlockOps.copy`); the block keeps its ref
count and its prefix-cache hash, and every request's table points at the new id. The answer, per request, is the
(index, block) replacements, which the scheduler passes on to its view of the workers. Compact blocks never move.
These functions choose what moves where; the table does the moving (`BlockTable.set_usable`, `BlockTable.move`).
"""

from __future__ import annotations

from scheduler_node.core.kv.block_table import BlockTable

Moves = dict[str, list[tuple[int, int]]]  # per request: (index in its table, new block)


def resize(table: BlockTable, usable: int) -> Moves:
    """Set the usable block count; live blocks at or above it move below (device copies).

    Returns, per request, the (index, block) replacements. Raises MemoryError when the live blocks do
    not fit under the new limit."""
    if not 1 <= usable <= table.num_blocks:
        raise ValueError(f"usable blocks must be in [1, {table.num_blocks}], got {usable}")
    live_above = table.held_blocks(usable, table.usable_blocks)
    free_below = sum(1 for b in table.free_blocks() if b < usable)
    if len(live_above) > free_below:
        raise MemoryError(f"{table.num_used} live blocks do not fit in {usable}")
    table.set_usable(usable)
    return _relocate(table, live_above)


def compact(table: BlockTable, max_moves: int) -> Moves:
    """Move up to `max_moves` of the highest live blocks into the lowest free ones below them."""
    free_low = table.free_blocks()
    moves: list[int] = []
    for block in reversed(table.held_blocks(0, table.usable_blocks)):
        if len(moves) == max_moves or not free_low or free_low[0] > block:
            break
        moves.append(block)
        free_low.pop(0)
    return _relocate(table, moves)


def _relocate(table: BlockTable, blocks: list[int]) -> Moves:
    """Each of these live blocks into the lowest free one, the lowest block first."""
    if not blocks:
        return {}
    return table.move(dict(zip(sorted(blocks), table.free_blocks())))
