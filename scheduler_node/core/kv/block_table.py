"""The global KV block table: fixed-size blocks with ref counts, prefix-cache hashes and copy-on-write.

Every request holds a list of device blocks. A full block whose KV is computed gets a chained hash (its
parent's hash and its token ids), so a later request with the same prefix reuses it. A freed block keeps its
hash in an LRU free queue until it is handed out again (lazy free). A block held by more than one request is
copied before it is written. Swap space on the workers' host memory has its own pool of host blocks.

Two formats (per-request KV precision, core/kv/precision.py): ids [0, num_blocks) are full blocks, ids
[num_blocks, num_blocks + num_compact_blocks) compact ones. Each pool has its own free list and its own prefix
cache, so a request holds blocks of one format only, copy-on-write copies within a pool, and a prefix hit never
crosses formats (the hashes stay format-neutral; the cache a hash is looked up in is the format's). Compact blocks
are never swapped (their requests are preempted by recompute) nor offloaded to the tiers (which hold full blocks),
and resizing or compaction (core/kv/relocation.py) moves full blocks only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from scheduler_node.core.kv.block_ops import UNCHANGED, BlockHash, BlockOps, Written, in_place_test
from scheduler_node.core.kv.precision import BlockFormat
from scheduler_node.core.kv.prefix_events import DEVICE, KVEventSink


class BlockTable:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        num_compact_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_compact_blocks < 0:
            raise ValueError(f"num_compact_blocks must be >= 0, got {num_compact_blocks}")
        self.num_blocks = num_blocks  # full blocks; the compact ones follow them
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.usable_blocks = num_blocks  # ResizeCache limit: blocks at or above it are never handed out
        # Called with (hash, block) when a cached block is handed out for new content: the KV offload tiers keep
        # it (scheduler_node/core/kv/tier_index.py). The plan's tier moves run before its copies and forward pass.
        self.on_evict: Callable[[BlockHash, int], None] | None = None
        # Told of every hash that enters or leaves the prefix cache (KV events for the router's `kv` strategy).
        self.events: KVEventSink | None = None
        self._empty(num_host_blocks, num_compact_blocks)

    def _empty(self, num_host_blocks: int, num_compact_blocks: int) -> None:
        """Every block free and uncached, within the usable limit; nothing collected for the next plan."""
        self.num_compact_blocks = num_compact_blocks
        total = self.num_blocks + num_compact_blocks
        self._ref_counts = [0] * total
        self._hash_of: list[BlockHash | None] = [None] * total
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.usable_blocks))  # LRU first
        self._compact_cached: dict[BlockHash, int] = {}
        self._compact_free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks, total))
        self._compact_reqs: set[str] = set()  # requests whose blocks are compact (the others' are full)
        self._tables: dict[str, list[int]] = {}
        self.num_host_blocks = num_host_blocks
        self._host_free = list(range(num_host_blocks - 1, -1, -1))
        self._host_tables: dict[str, list[int]] = {}
        self.ops = BlockOps()  # collected for the next plan
        self.writes_in_place = in_place_test(self._tables, self._ref_counts, self.block_size)

    def reset(self, num_host_blocks: int, num_compact_blocks: int) -> None:
        """Start empty, with the same device blocks and usable limit (a lost rank, a smaller world): nothing is
        held or cached any more. The same object: whoever was handed the table keeps it."""
        self._empty(num_host_blocks, num_compact_blocks)
        if self.events is not None:
            self.events.cleared(DEVICE)

    # ---- reading

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.usable_blocks

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if self._hash_of[b] is not None)

    @property
    def num_compact_free(self) -> int:
        return len(self._compact_free)

    @property
    def num_compact_used(self) -> int:
        return self.num_compact_blocks - len(self._compact_free)

    def num_free_of(self, fmt: BlockFormat) -> int:
        return len(self._compact_free) if fmt is BlockFormat.COMPACT else len(self._free)

    def format_of(self, req_id: str) -> BlockFormat:
        """The format of the blocks a request holds (or will hold once it acquires them)."""
        return BlockFormat.COMPACT if req_id in self._compact_reqs else BlockFormat.FULL

    def block_format(self, block: int) -> BlockFormat:
        return BlockFormat.COMPACT if block >= self.num_blocks else BlockFormat.FULL

    @property
    def num_host_used(self) -> int:
        return self.num_host_blocks - len(self._host_free)

    def is_free(self, block: int) -> bool:
        return block in (self._compact_free if block >= self.num_blocks else self._free)

    def blocks_of(self, req_id: str) -> list[int]:
        return self._tables.get(req_id, [])

    def host_blocks_of(self, req_id: str) -> list[int]:
        return self._host_tables.get(req_id, [])

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        return ops

    # ---- growth and copy-on-write

    def blocks_needed(self, req_id: str, first: int, end: int) -> int:
        """Free blocks needed so positions [first, end) can be written: new blocks plus shared ones to copy."""
        table = self._tables.get(req_id, [])
        new = max(0, self.blocks_for(end) - len(table))
        last_held = min(len(table), self.blocks_for(end))
        shared = sum(1 for i in range(first // self.block_size, last_held) if self._ref_counts[table[i]] > 1)
        return new + shared

    def can_write(self, req_id: str, first: int, end: int, reserve: int = 0) -> bool:
        return self.blocks_needed(req_id, first, end) + reserve <= self.num_free_of(self.format_of(req_id))

    def write(self, req_id: str, first: int, end: int) -> Written | None:
        """Make positions [first, end) writable if the free blocks allow: copy shared blocks, append new ones.

        Returns the appended blocks and the (index, block) replacements made by copy-on-write, or None (and changes
        nothing) when blocks are short. The one capacity check of a step: a decode that stays in its last block
        touches one entry."""
        bs = self.block_size
        if (end - 1) // bs == first // bs and self.writes_in_place(req_id, first):
            return UNCHANGED  # within one block of its own (a decode, mostly)
        held = self._tables.get(req_id)
        table = held if held is not None else []
        refs = self._ref_counts
        last = (end + bs - 1) // bs  # blocks that hold positions up to end
        new = last - len(table) if last > len(table) else 0
        shared = [i for i in range(first // bs, min(len(table), last)) if refs[table[i]] > 1]
        compact = req_id in self._compact_reqs
        if new + len(shared) > len(self._compact_free if compact else self._free):
            return None
        if not new and not shared:
            return UNCHANGED
        if held is None:
            self._tables[req_id] = table
        replaced = []
        for i in shared:  # the copy stays in the request's pool: a copy never converts between formats
            src, dst = table[i], self._pop_free(compact)
            refs[src] -= 1
            table[i] = dst
            self.ops.copy.append((src, dst))
            replaced.append((i, dst))
        added = [self._pop_free(compact) for _ in range(new)]
        table.extend(added)
        return Written(added, replaced)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """The child shares the parent's blocks that hold its first `num_tokens` tokens."""
        shared = self._tables[parent_id][: self.blocks_for(num_tokens)]
        for block in shared:
            self._ref_counts[block] += 1
        self._tables[child_id] = list(shared)
        if parent_id in self._compact_reqs:
            self._compact_reqs.add(child_id)

    def free(self, req_id: str) -> int:
        """Release every block the request holds (device and host); return how many device blocks."""
        blocks = self._tables.pop(req_id, [])
        for block in reversed(blocks):  # the tail goes back first, so it is evicted before the shared head
            self._release(block)
        self._host_free.extend(self._host_tables.pop(req_id, []))
        self._compact_reqs.discard(req_id)
        return len(blocks)

    # ---- prefix caching

    def match_prefix(self, hashes: Sequence[BlockHash], fmt: BlockFormat = BlockFormat.FULL) -> list[int]:
        """The cached blocks of this format holding the longest prefix of these block hashes."""
        if not self.enable_prefix_caching:
            return []
        cached = self._compact_cached if fmt is BlockFormat.COMPACT else self._cached
        blocks = []
        for h in hashes:
            block = cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, req_id: str, blocks: list[int], fmt: BlockFormat = BlockFormat.FULL) -> None:
        """Give a request that holds nothing yet these cached blocks (prefix hit) of format `fmt`: every block it
        gets from now on is of that format."""
        assert req_id not in self._tables
        compact = fmt is BlockFormat.COMPACT
        free = self._compact_free if compact else self._free
        for block in blocks:
            if (block >= self.num_blocks) != compact:
                raise ValueError(f"block {block} is not a {fmt.name.lower()} block")
            if self._ref_counts[block] == 0:
                del free[block]
            self._ref_counts[block] += 1
        self._tables[req_id] = list(blocks)
        if compact:
            self._compact_reqs.add(req_id)

    def register(self, req_id: str, hashes: Sequence[BlockHash], first: int = 0, end: int | None = None) -> None:
        """Record the hashes of the request's blocks [first, end) (default: up to len(hashes)), now full and
        computed; hashes[i] is block i's. The scheduler passes the blocks a step filled, so a decode registers one
        block in block_size steps, whatever its context length."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(req_id, [])
        cached = self._compact_cached if req_id in self._compact_reqs else self._cached
        for i in range(first, min(len(table), len(hashes) if end is None else end)):
            block, h = table[i], hashes[i]
            if self._hash_of[block] is None and h not in cached:
                self._hash_of[block] = h
                cached[h] = block
                if self.events is not None:
                    self.events.stored(DEVICE, h, hashes[i - 1] if i else None)

    def uncache(self, h: BlockHash) -> int | None:
        """Forget that a block holds `h` (its content turned out not to be valid): no later prefix matches it.
        Returns that block, or None when none held it. Only loads from the offload tiers fail, and those fill full
        blocks: a compact block of the same hash was computed here, and stays."""
        block = self._cached.get(h)
        if block is not None:
            self._evict(block)
        return block

    # ---- swap

    def can_swap_out(self, req_id: str) -> bool:
        """Host blocks are full blocks: a compact request is never swapped (it is recomputed)."""
        return req_id not in self._compact_reqs and len(self._tables.get(req_id, [])) <= len(self._host_free)

    def swap_out(self, req_id: str) -> int:
        blocks = self._tables.pop(req_id)
        host = [self._host_free.pop() for _ in blocks]
        self.ops.swap_out.extend(zip(blocks, host))
        for block in reversed(blocks):
            self._release(block)
        self._host_tables[req_id] = host
        return len(blocks)

    def can_swap_in(self, req_id: str, reserve: int = 0) -> bool:
        return len(self._host_tables.get(req_id, [])) + reserve <= len(self._free)

    def swap_in(self, req_id: str) -> int:
        host = self._host_tables.pop(req_id)
        blocks = [self._pop_free() for _ in host]
        self.ops.swap_in.extend(zip(host, blocks))
        self._host_free.extend(host)
        self._tables[req_id] = blocks
        return len(blocks)

    # ---- relocation (core/kv/relocation.py chooses which blocks move where)

    def held_blocks(self, start: int, end: int) -> list[int]:
        """The full blocks in [start, end) that some request holds."""
        return [b for b in range(start, end) if self._ref_counts[b] > 0]

    def free_blocks(self) -> list[int]:
        """The free full blocks, lowest first."""
        return sorted(self._free)

    def set_usable(self, usable: int) -> None:
        """Hand out full blocks below `usable` only: the free ones at or above it leave the free list (their content
        forgotten), those between the old limit and it join it. The live ones above it are moved by the caller."""
        for b in range(usable, self.usable_blocks):
            if b in self._free:
                del self._free[b]
                self._evict(b)
        for b in range(self.usable_blocks, usable):
            self._free[b] = None
        self.usable_blocks = usable

    def move(self, target: dict[int, int]) -> dict[str, list[tuple[int, int]]]:
        """Move live full blocks into free ones (source: destination), a device copy before the step's forward pass;
        each keeps its ref count and prefix-cache hash, and every table points at the new id. Returns, per request,
        the (index, block) replacements."""
        refs, hash_of = self._ref_counts, self._hash_of
        for block, dst in sorted(target.items()):
            del self._free[dst]
            self._evict(dst)  # its cached content is overwritten
            self.ops.copy.append((block, dst))
            refs[dst], refs[block] = refs[block], 0
            h = hash_of[block]
            if h is not None:
                hash_of[dst], hash_of[block] = h, None
                self._cached[h] = dst
            if block < self.usable_blocks:
                self._free[block] = None
        updates: dict[str, list[tuple[int, int]]] = {}
        for req_id, table in self._tables.items():
            for i, block in enumerate(table):
                if block in target:
                    table[i] = target[block]
                    updates.setdefault(req_id, []).append((i, target[block]))
        return updates

    # ---- internals

    def _pop_free(self, compact: bool = False) -> int:
        block, _ = (self._compact_free if compact else self._free).popitem(last=False)
        h = self._hash_of[block]
        if h is not None and not compact and self.on_evict is not None and not self._copied_into(block):
            self.on_evict(h, block)  # the tiers keep full blocks only
        self._evict(block)
        self._ref_counts[block] = 1
        return block

    def _copied_into(self, block: int) -> bool:
        """A copy of this plan writes the block (compaction moved a cached block there): its content exists only
        after the copies run, later than the tier moves would read it."""
        return any(dst == block for _, dst in self.ops.copy)

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            self._hash_of[block] = None
            cached = self._compact_cached if block >= self.num_blocks else self._cached
            if cached.get(h) == block:
                del cached[h]
                if self.events is not None and h not in self._cached and h not in self._compact_cached:
                    self.events.removed(DEVICE, h)  # the last copy of it left the device

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block >= self.num_blocks:
                self._compact_free[block] = None
            elif block < self.usable_blocks:
                self._free[block] = None
            else:  # above a shrunk limit: forget its content, never hand it out
                self._evict(block)

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests and debugging)."""
        holders = [0] * (self.num_blocks + self.num_compact_blocks)
        for req_id, blocks in self._tables.items():
            fmt = self.format_of(req_id)
            for block in blocks:
                holders[block] += 1
                if self.block_format(block) is not fmt:
                    raise AssertionError(f"{req_id} ({fmt.name}) holds block {block} of the other format")
        if holders != self._ref_counts:
            raise AssertionError("ref counts differ from holders")
        for block in range(self.num_blocks + self.num_compact_blocks):
            compact = block >= self.num_blocks
            is_free = block in (self._compact_free if compact else self._free)
            if (compact or block < self.usable_blocks) and is_free == (self._ref_counts[block] > 0):
                raise AssertionError(f"block {block} is both free and held, or neither")
            if not compact and block >= self.usable_blocks and (is_free or self._ref_counts[block]):
                raise AssertionError(f"block {block} is above the usable limit but in use")
        if any(b >= self.num_blocks for b in self._free) or any(b < self.num_blocks for b in self._compact_free):
            raise AssertionError("a block is on the other format's free list")
        for cached, compact in ((self._cached, False), (self._compact_cached, True)):
            for h, block in cached.items():
                if self._hash_of[block] != h:
                    raise AssertionError(f"hash points at block {block}, which holds other tokens")
                if (block >= self.num_blocks) != compact:
                    raise AssertionError(f"block {block} is cached in the other format's prefix cache")
        host_held = [b for t in self._host_tables.values() for b in t]
        if sorted(host_held + self._host_free) != list(range(self.num_host_blocks)):
            raise AssertionError("host blocks leaked or double-booked")
