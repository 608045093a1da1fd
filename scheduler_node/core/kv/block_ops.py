"""What the block table (core/kv/block_table.py) hands out: a full block's chained hash, what a write changed in a
request's table, the device work a step's blocks need (`BlockOps`), and the test of a write that changes nothing."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str = "", extra: bytes = b"") -> BlockHash:
    """The chained hash of one full block; the salt seeds the chain so tenants can opt out of sharing. `extra`:
    what the block holds besides its tokens (the content hashes of the images whose placeholders it covers)."""
    seed = parent if parent is not None else hashlib.blake2b(salt.encode(), digest_size=16).digest()
    return hashlib.blake2b(seed + array("q", token_ids).tobytes() + extra, digest_size=16).digest()


class Written(NamedTuple):
    """What making positions writable changed in a request's table."""

    added: list[int]  # blocks appended
    replaced: list[tuple[int, int]]  # (index, block): shared blocks copied before the write


UNCHANGED = Written([], [])  # never mutated: callers only read it (the scheduler tests `is UNCHANGED`)


@dataclass(slots=True)
class BlockOps:
    """Device work the workers do before a step's forward pass, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (source block, destination block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def pending(self) -> bool:
        return bool(self.copy or self.swap_out or self.swap_in)


def in_place_test(tables: dict[str, list[int]], ref_counts: list[int], block_size: int) -> Callable[[str, int], bool]:
    """`BlockTable.writes_in_place`: may a request write position p without a change to its table? When it holds
    p's block already and is that block's only holder. The first test of `write`, and the scheduler's steady-decode
    test (one call per running request per step: a closure over the table's own containers, no attribute lookups)."""

    def writes_in_place(req_id: str, position: int) -> bool:
        table = tables.get(req_id)
        block = position // block_size
        return table is not None and block < len(table) and ref_counts[table[block]] == 1

    return writes_in_place
