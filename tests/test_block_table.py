from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_node.block_table import BlockTable


def test_grow_allocates_only_missing_blocks_and_free_returns_them() -> None:
    table = BlockTable(num_blocks=8, block_size=4)
    assert table.grow("a", 5) == [0, 1]  # 5 tokens need 2 blocks
    assert table.grow("a", 8) == []  # still fits in 2
    assert table.grow("a", 9) == [2]
    assert table.num_free == 5
    assert table.free("a") == 3
    assert table.num_free == 8
    table.check_invariants()


def test_grow_beyond_capacity_raises_and_can_grow_says_so() -> None:
    table = BlockTable(num_blocks=2, block_size=4)
    assert table.can_grow("a", 8)
    assert not table.can_grow("a", 9)
    with pytest.raises(MemoryError):
        table.grow("a", 9)
    assert table.num_free == 2  # nothing half-allocated


def test_bad_size_is_rejected() -> None:
    with pytest.raises(ValueError):
        BlockTable(0, 16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("grow free".split()), st.integers(0, 5), st.integers(1, 40))))
def test_random_operations_keep_invariants(ops: list[tuple[str, int, int]]) -> None:
    table = BlockTable(num_blocks=16, block_size=4)
    for op, who, tokens in ops:
        req = f"r{who}"
        if op == "grow":
            if table.can_grow(req, tokens):
                table.grow(req, tokens)
                assert len(table.blocks_of(req)) >= table.blocks_for(tokens)
        else:
            table.free(req)
        table.check_invariants()
        assert table.num_free + table.num_used == table.num_blocks
    for who in range(6):
        table.free(f"r{who}")
    assert table.num_free == table.num_blocks
