"""Resizing and compaction of the block table: what moves where, and what a move keeps (ref counts, prefix-cache
hashes). Under random operations, against a model of the workers' blocks: test_block_table.py's state machine."""

from __future__ import annotations

import pytest

from scheduler_node.core.kv.block_ops import hash_block
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.precision import BlockFormat
from scheduler_node.core.kv.relocation import compact, resize

pytestmark = pytest.mark.unit

BS = 4


def test_shrinking_moves_the_live_blocks_above_the_limit_into_the_lowest_free_ones() -> None:
    table = BlockTable(num_blocks=8, block_size=BS)
    table.write("low", 0, 8)  # blocks 0, 1
    table.write("gap", 0, 8)  # blocks 2, 3: freed below, leaving room
    table.write("high", 0, 12)  # blocks 4, 5, 6
    table.free("gap")
    table.take_ops()
    assert resize(table, 5) == {"high": [(1, 2), (2, 3)]}  # blocks 5 and 6 move to 2 and 3; 4 stays
    assert table.blocks_of("high") == [4, 2, 3] and table.blocks_of("low") == [0, 1]
    assert table.take_ops().copy == [(5, 2), (6, 3)]
    assert table.usable_blocks == 5 and table.num_free == 0
    table.check_invariants()


def test_a_moved_block_keeps_its_hash_and_its_sharers() -> None:
    table = BlockTable(num_blocks=4, block_size=BS)
    h = hash_block(None, [1, 2, 3, 4])
    table.write("pad", 0, 8)  # blocks 0, 1
    table.write("a", 0, 4)  # block 2
    table.register("a", [h])
    table.fork("a", "b", 4)
    table.free("pad")
    assert resize(table, 2) == {"a": [(0, 0)], "b": [(0, 0)]}
    assert table.match_prefix([h]) == [0]  # the prefix cache follows the block
    table.free("a")
    assert not table.is_free(0)  # b still holds it
    table.check_invariants()


def test_a_shrink_the_live_blocks_do_not_fit_changes_nothing() -> None:
    table = BlockTable(num_blocks=4, block_size=BS)
    table.write("a", 0, 12)
    with pytest.raises(MemoryError, match="3 live blocks do not fit in 2"):
        resize(table, 2)
    with pytest.raises(ValueError, match=r"usable blocks must be in \[1, 4\], got 5"):
        resize(table, 5)
    assert table.usable_blocks == 4 and table.blocks_of("a") == [0, 1, 2] and table.take_ops().copy == []
    table.check_invariants()


def test_growing_brings_the_blocks_back_and_forgets_what_they_held() -> None:
    table = BlockTable(num_blocks=4, block_size=BS)
    h = hash_block(None, [1, 2, 3, 4])
    table.write("pad", 0, 12)  # blocks 0, 1, 2
    table.write("a", 0, 4)  # block 3
    table.register("a", [h])
    table.free("pad")
    table.free("a")  # block 3 free, still cached
    assert resize(table, 2) == {}  # nothing live above 2: the free blocks there are dropped, with their hashes
    assert table.match_prefix([h]) == [] and table.num_free == 2
    resize(table, 4)
    assert table.num_free == 4
    table.check_invariants()


def test_compaction_moves_at_most_max_moves_of_the_highest_live_blocks_down() -> None:
    table = BlockTable(num_blocks=8, block_size=BS)
    table.write("pad", 0, 20)  # blocks 0-4
    table.write("a", 0, 12)  # blocks 5, 6, 7
    table.free("pad")
    table.take_ops()
    assert compact(table, max_moves=2) == {"a": [(1, 0), (2, 1)]}  # 6 and 7 move (the highest), 5 stays
    assert table.take_ops().copy == [(6, 0), (7, 1)]
    assert compact(table, max_moves=2) == {"a": [(0, 2)]}  # then 5; above no free block: done
    assert table.blocks_of("a") == [2, 0, 1] and compact(table, max_moves=2) == {}
    table.check_invariants()


def test_compact_blocks_never_move() -> None:
    table = BlockTable(num_blocks=2, block_size=BS, num_compact_blocks=4)
    table.acquire("c", [], BlockFormat.COMPACT)
    table.write("c", 0, 8)
    assert table.blocks_of("c") == [2, 3]
    assert compact(table, max_moves=4) == {} and resize(table, 1) == {}
    assert table.blocks_of("c") == [2, 3]
    table.check_invariants()
