"""The block table under random operations (resizing and compaction, core/kv/relocation.py, among them), against
a model of what each block would hold on the workers."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_node.core.kv import relocation as block_relocation
from scheduler_node.core.kv.block_ops import hash_block
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.precision import BlockFormat

pytestmark = pytest.mark.unit

BS = 4


def test_write_allocates_only_missing_blocks_and_free_returns_them() -> None:
    table = BlockTable(num_blocks=8, block_size=BS)
    assert table.write("a", 0, 5) == ([0, 1], [])  # 5 tokens need 2 blocks
    assert table.write("a", 5, 8) == ([], [])  # still fits in 2
    assert table.write("a", 8, 9) == ([2], [])
    assert table.num_free == 5
    assert table.free("a") == 3
    assert table.num_free == 8
    table.check_invariants()


def test_writing_beyond_capacity_changes_nothing_and_can_write_says_so() -> None:
    table = BlockTable(num_blocks=2, block_size=BS)
    assert table.can_write("a", 0, 8)
    assert not table.can_write("a", 0, 9)
    assert table.write("a", 0, 9) is None
    assert table.num_free == 2 and table.blocks_of("a") == []  # nothing half-allocated
    table.check_invariants()


def test_prefix_hit_reuses_freed_blocks_until_they_are_handed_out_again() -> None:
    table = BlockTable(num_blocks=4, block_size=BS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    hashes = [hash_block(None, tokens[:4]), hash_block(hash_block(None, tokens[:4]), tokens[4:8])]
    table.write("a", 0, 9)
    table.register("a", hashes)
    table.free("a")
    assert table.num_cached_free == 2
    assert table.match_prefix(hashes) == table.match_prefix(hashes)[:2] and len(table.match_prefix(hashes)) == 2
    assert table.match_prefix([hash_block(None, tokens[:4], salt="tenant-b")]) == []  # salted: no sharing
    table.write("b", 0, 16)  # takes every block: the cached ones are evicted (lazy free)
    assert table.match_prefix(hashes) == []
    table.check_invariants()


def test_shared_block_is_copied_before_it_is_written() -> None:
    table = BlockTable(num_blocks=8, block_size=BS)
    table.write("parent", 0, 6)
    table.fork("parent", "child", 6)
    written = table.write("child", 5, 7)  # position 5 sits in the shared second block
    assert written is not None, "two free blocks are enough"
    added, replaced = written
    assert added == [] and [i for i, _ in replaced] == [1]
    assert table.take_ops().copy == [(table.blocks_of("parent")[1], table.blocks_of("child")[1])]
    assert table.blocks_of("child")[0] == table.blocks_of("parent")[0]  # the full first block stays shared
    table.check_invariants()


def test_bad_size_is_rejected() -> None:
    with pytest.raises(ValueError):
        BlockTable(0, 16)


Slot = tuple[BlockFormat, int] | None  # what a worker's slot holds: a token, written in its request's format


class BlockTableMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / preempt (recompute, swap) / resume / resize / compact, over two
    block formats (full and compact, per-request KV precision): each request gets one at admission, and a
    request resumed after a recompute preemption may get the other."""

    def __init__(self) -> None:
        super().__init__()
        self.table = BlockTable(num_blocks=12, block_size=BS, num_host_blocks=6, num_compact_blocks=8)
        self.device: dict[int, list[Slot]] = {b: [None] * BS for b in range(20)}
        self.host: dict[int, list[Slot]] = {b: [None] * BS for b in range(6)}
        self.format: dict[str, BlockFormat] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.where: dict[str, str] = {}  # device | host | none (preempted by recompute)
        self.block_tokens: dict[bytes, tuple[int, ...]] = {}
        self.next_id = 0

    # ---- helpers that play the workers' part

    def _apply_ops(self) -> None:
        ops = self.table.take_ops()
        for dev, host in ops.swap_out:
            self.host[host] = list(self.device[dev])
        for src, dst in ops.copy:
            self.device[dst] = list(self.device[src])
        for host, dev in ops.swap_in:
            self.device[dev] = list(self.host[host])

    def _hashes(self, tokens: list[int]) -> list[bytes]:
        out: list[bytes] = []
        for i in range(len(tokens) // BS):
            out.append(hash_block(out[-1] if out else None, tokens[i * BS : (i + 1) * BS]))
        return out

    def _compute(self, rid: str, first: int, end: int) -> None:
        self.table.write(rid, first, end)
        self._apply_ops()  # copy-on-write happens before the forward pass writes
        table = self.table.blocks_of(rid)
        fmt = self.table.format_of(rid)
        for p in range(first, end):
            self.device[table[p // BS]][p % BS] = (fmt, self.tokens[rid][p])
        self.computed[rid] = end
        hashes = self._hashes(self.tokens[rid])[: end // BS]
        self.table.register(rid, hashes)
        for i, h in enumerate(hashes):
            self.block_tokens.setdefault(h, tuple(self.tokens[rid][i * BS : (i + 1) * BS]))

    def _admit(self, rid: str, fmt: BlockFormat) -> bool:
        tokens = self.tokens[rid]
        hits = self.table.match_prefix(self._hashes(tokens)[: (len(tokens) - 1) // BS], fmt)
        reused_free = sum(1 for b in hits if self.table.is_free(b))
        if self.table.blocks_for(len(tokens)) - len(hits) + reused_free > self.table.num_free_of(fmt):
            return False
        self.table.acquire(rid, hits, fmt)
        self.format[rid] = fmt
        self._compute(rid, len(hits) * BS, len(tokens))
        self.where[rid] = "device"
        return True

    def _on(self, where: str) -> list[str]:
        return sorted(r for r, w in self.where.items() if w == where)

    # ---- rules

    @rule(prompt=st.lists(st.integers(1, 2), min_size=1, max_size=14), fmt=st.sampled_from(BlockFormat))
    def new_request(self, prompt: list[int], fmt: BlockFormat) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.tokens[rid] = list(prompt)
        if not self._admit(rid, fmt):
            del self.tokens[rid]

    @precondition(lambda self: self._on("device"))
    @rule(data=st.data(), extra=st.lists(st.integers(1, 2), min_size=1, max_size=6))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        rid = data.draw(st.sampled_from(self._on("device")))
        first = self.computed[rid]
        if self.table.can_write(rid, first, first + len(extra)):
            self.tokens[rid].extend(extra)
            self._compute(rid, first, len(self.tokens[rid]))

    @precondition(lambda self: self._on("device"))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._on("device")))
        n = len(self.tokens[parent])
        child = f"r{self.next_id}"
        self.next_id += 1
        self.table.fork(parent, child, n)
        self.format[child] = self.format[parent]
        self.tokens[child] = list(self.tokens[parent])
        self.where[child] = "device"
        self.computed[child] = n - 1
        if self.table.can_write(child, n - 1, n):
            self._compute(child, n - 1, n)  # the sibling recomputes the last prompt token: copy-on-write
        else:
            self._drop(child)

    @precondition(lambda self: self.where)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._drop(data.draw(st.sampled_from(sorted(self.where))))

    @precondition(lambda self: self._on("device"))
    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._on("device")))
        self.table.free(rid)
        self.where[rid] = "none"

    @precondition(lambda self: self._on("device"))
    @rule(data=st.data())
    def preempt_swap(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._on("device")))
        if self.table.can_swap_out(rid):
            self.table.swap_out(rid)
            self._apply_ops()
            self.where[rid] = "host"

    @precondition(lambda self: self._on("host") or self._on("none"))
    @rule(data=st.data(), fmt=st.sampled_from(BlockFormat))
    def resume(self, data: st.DataObject, fmt: BlockFormat) -> None:
        rid = data.draw(st.sampled_from(self._on("host") + self._on("none")))
        if self.where[rid] == "none":  # recomputed: in whichever format it gets now
            self._admit(rid, fmt)
        elif self.table.can_swap_in(rid):
            self.table.swap_in(rid)
            self._apply_ops()
            self.where[rid] = "device"

    @rule(usable=st.integers(1, 12))
    def resize(self, usable: int) -> None:
        try:
            block_relocation.resize(self.table, usable)
        except MemoryError:
            return
        self._apply_ops()

    @rule()
    def compact(self) -> None:
        block_relocation.compact(self.table, max_moves=3)
        self._apply_ops()

    def _drop(self, rid: str) -> None:
        self.table.free(rid)
        for d in (self.tokens, self.computed, self.where, self.format):
            d.pop(rid, None)

    # ---- invariants

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.table.check_invariants()  # ref counts = holders; no request holds a block of the other format
        assert self.table.num_free + self.table.num_used == self.table.usable_blocks
        assert self.table.num_compact_free + self.table.num_compact_used == self.table.num_compact_blocks
        held = {fmt: set() for fmt in BlockFormat}  # type: ignore[var-annotated]
        for rid in self._on("device"):
            held[self.format[rid]].update(self.table.blocks_of(rid))
        assert not held[BlockFormat.FULL] & held[BlockFormat.COMPACT], "a block is shared across formats"
        assert len(held[BlockFormat.COMPACT]) == self.table.num_compact_used, "compact blocks leaked or lost"

    @invariant()
    def every_request_reads_its_own_tokens_in_its_own_format(self) -> None:
        for rid in self._on("device"):
            table, fmt = self.table.blocks_of(rid), self.format[rid]
            stored = [self.device[table[p // BS]][p % BS] for p in range(self.computed[rid])]
            assert stored == [(fmt, t) for t in self.tokens[rid][: self.computed[rid]]], rid

    @invariant()
    def no_hash_points_at_other_tokens_or_another_format(self) -> None:
        for fmt, cached in ((BlockFormat.FULL, self.table._cached), (BlockFormat.COMPACT, self.table._compact_cached)):
            for h, block in cached.items():
                assert self.device[block] == [(fmt, t) for t in self.block_tokens[h]]

    def teardown(self) -> None:
        for rid in list(self.where):
            self._drop(rid)
        assert self.table.num_free == self.table.usable_blocks  # idle: all free
        assert self.table.num_compact_free == self.table.num_compact_blocks
        assert self.table.num_host_used == 0


TestBlockTableMachine = BlockTableMachine.TestCase
TestBlockTableMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
