"""The global KV block table: fixed-size blocks with ref counts, allocated on growth, freed on finish."""

from __future__ import annotations

from collections import deque


class BlockTable:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_of(self, req_id: str) -> list[int]:
        return self._tables.get(req_id, [])

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks the request still needs so that `num_tokens` tokens have a slot."""
        return max(0, self.blocks_for(num_tokens) - len(self.blocks_of(req_id)))

    def can_grow(self, req_id: str, num_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks(req_id, num_tokens) + reserve <= len(self._free)

    def grow(self, req_id: str, num_tokens: int) -> list[int]:
        """Give the request enough blocks for `num_tokens` tokens; return the blocks added."""
        need = self.extra_blocks(req_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"{req_id} needs {need} blocks, {len(self._free)} free")
        added = [self._free.popleft() for _ in range(need)]
        for block in added:
            self._ref_counts[block] = 1
        self._tables.setdefault(req_id, []).extend(added)
        return added

    def free(self, req_id: str) -> int:
        """Release every block the request holds; return how many."""
        blocks = self._tables.pop(req_id, [])
        for block in reversed(blocks):  # the tail goes back last: LIFO reuse of recent blocks
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        return len(blocks)

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests and debugging)."""
        holders = [0] * self.num_blocks
        for blocks in self._tables.values():
            for block in blocks:
                holders[block] += 1
        if holders != self._ref_counts:
            raise AssertionError("ref counts differ from holders")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is free twice")
        for block in range(self.num_blocks):
            if (block in free) == (self._ref_counts[block] > 0):
                raise AssertionError(f"block {block} is both free and held, or neither")
