"""What a waiting request's start takes from the block table: the one fit check of admission and displacement
(`blocks_to_start`), and claiming those blocks (`claim`), with their prefix-cache hits, the blocks loaded back from
the offload tiers and the KV imported from another replica instead of being computed."""

from __future__ import annotations

from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.counters import SchedulerCounters
from scheduler_node.core.kv.block_ops import BlockHash
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.leases import KVLeases
from scheduler_node.core.kv.precision import BlockFormat, CompactKV, choose_format
from scheduler_node.core.kv.tier_index import KVTiers
from scheduler_node.core.migrations_in import MigrationsIn
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request

Start = tuple[int, list[int], int, BlockFormat]  # blocks to take, cached blocks reused, blocks loaded, format


class BlockClaims:
    def __init__(
        self,
        config: SchedulerConfig,
        queues: RequestQueues,
        blocks: BlockTable,
        precision: CompactKV,
        tiers: KVTiers | None,
        leases: KVLeases,
        migrations: MigrationsIn,
        counters: SchedulerCounters,
    ) -> None:
        self.config = config
        self.queues = queues
        self.blocks = blocks
        self.precision = precision
        self.tiers = tiers
        self.leases = leases
        self.migrations = migrations
        self.counters = counters

    def fits(self, req: Request, budget: int) -> bool:
        """Would a waiting request get its blocks now (prefix-cache hits counted), the watermark kept?"""
        need, _, _, fmt = self.blocks_to_start(req, budget)
        return need + self.watermark(fmt) <= self.blocks.num_free_of(fmt)

    def blocks_to_start(self, req: Request, budget: int) -> Start:
        """Free blocks a waiting request takes to start its next chunk, the cached blocks it would reuse, how
        many blocks after those it would load from the offload tiers (into new blocks) instead of computing, and
        the format of its blocks (one that holds blocks keeps theirs; a new one's is chosen: core/kv/precision.py).

        The one fit check of admission and displacement: a swapped request brings its blocks back, a fork (n > 1)
        writes into its shared prompt blocks, a new or recomputed one reuses its longest cached prefix (a cached
        block on the free list counts against the free blocks, since taking it removes it from there)."""
        bt = self.blocks
        first = req.num_computed_tokens
        if req.swapped:
            n = min(req.num_tokens - first, budget)
            return max(bt.blocks_for(first + n), len(bt.host_blocks_of(req.req_id))), [], 0, BlockFormat.FULL
        if bt.blocks_of(req.req_id):
            need = bt.blocks_needed(req.req_id, first, first + min(req.num_tokens - first, budget))
            return need, [], 0, bt.format_of(req.req_id)
        hashes = req.update_block_hashes(bt.block_size)
        cacheable = (req.num_tokens - 1) // bt.block_size  # the last token is recomputed
        if req.sampling.prompt_logprobs is not None and not req.prompt_logprobs_done:
            cacheable = 0  # a cached prefix has no logits: the prompt is computed in full to score every token
        if req.sampling.pooling == "mean":
            cacheable = 0  # nor hidden states: the mean pools every prompt token
        starts: dict[BlockFormat, Start] = {}

        def start(fmt: BlockFormat) -> Start:
            """What starting in this format takes; worked out once per format (the choice below asks too)."""
            if fmt not in starts:
                starts[fmt] = self._start_in(req, fmt, hashes, cacheable, budget)
            return starts[fmt]

        def left(fmt: BlockFormat) -> int:
            if fmt is BlockFormat.COMPACT and bt.blocks_for(req.num_tokens_at_most) > bt.num_compact_blocks:
                return -1  # it could never finish there (it would be preempted, come back compact, and again)
            return bt.num_free_of(fmt) - self.watermark(fmt) - start(fmt)[0]

        fmt = choose_format(
            req.kv_precision, req.priority, self.precision, bt.num_compact_blocks > 0, left, bt.usable_blocks
        )
        return start(fmt)

    def _start_in(self, req: Request, fmt: BlockFormat, hashes: list[BlockHash], cacheable: int, budget: int) -> Start:
        """`blocks_to_start` of a request that holds no blocks, in this format."""
        bt = self.blocks
        hits = bt.match_prefix(hashes[:cacheable], fmt)
        tiers = self.tiers if fmt is BlockFormat.FULL else None  # the tiers hold full blocks
        loads = tiers.match(hashes[len(hits) : cacheable]) if tiers is not None else 0
        partial = 0
        if req.kv_source is not None:  # pulled from another replica instead (core/kv/leases.py)
            loads, partial = self._remote_loads(req, len(hits), cacheable, fmt)
        hit_tokens = (len(hits) + loads) * bt.block_size + partial
        n = min(req.num_tokens - hit_tokens, budget)
        reused_free = sum(1 for b in hits if bt.is_free(b))
        return bt.blocks_for(hit_tokens + n) - len(hits) + reused_free, hits, loads, fmt

    def watermark(self, fmt: BlockFormat) -> int:
        """Blocks admission keeps free for the running requests to grow into; none when nothing runs: a request
        that needs the whole cache would otherwise never start."""
        if not self.queues.running:
            return 0
        pool = self.blocks.num_compact_blocks if fmt is BlockFormat.COMPACT else self.blocks.usable_blocks
        return int(self.config.watermark * pool)

    def claim(self, req: Request, budget: int) -> bool:
        """Take the blocks a waiting request needs to start (see `blocks_to_start`); False if they are short."""
        bt = self.blocks
        need, hits, loads, fmt = self.blocks_to_start(req, budget)
        if need + self.watermark(fmt) > bt.num_free_of(fmt):
            return False
        if req.swapped:
            bt.swap_in(req.req_id)
            req.swapped = False
            # Its computed blocks are back (the swap-in runs before this step reads them) under new block ids.
            bt.register(req.req_id, req.update_block_hashes(bt.block_size), 0, req.num_computed_tokens // bt.block_size)
        elif not bt.blocks_of(req.req_id):
            self._claim_new(req, hits, loads, fmt)
        req.kv_source = None  # used once: a request that recomputes later computes its prompt here
        return True

    def _claim_new(self, req: Request, hits: list[int], loads: int, fmt: BlockFormat) -> None:
        """`claim` of a request that holds no blocks: its cached prefix, then what it loads instead of computing."""
        bt = self.blocks
        partial = self._remote_loads(req, len(hits), len(hits) + loads, fmt)[1] if req.kv_source else 0
        hit_tokens = (len(hits) + loads) * bt.block_size + partial
        if req.num_preemptions == 0 and not req.output_token_ids:  # new prompts only: resumptions inflate it
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += hit_tokens
            req.num_cached_tokens = hit_tokens
        bt.acquire(req.req_id, hits, fmt)
        if loads or partial:
            hashes = req.update_block_hashes(bt.block_size)
            if req.kv_source is not None:
                self._load_from_remote(req, len(hits), hashes[len(hits) : len(hits) + loads], partial)
                if req.migrated_in:  # its import's result settles it (`MigrationsIn.settle`)
                    self.migrations.pull(req, self.leases.imports[-1])
            else:
                self._load_from_tiers(req, hashes[len(hits) : len(hits) + loads])
            bt.register(req.req_id, hashes[: len(hits) + loads])
        if req.migrated_in:
            self.migrations.count(req, hit_tokens, loads * bt.block_size + partial if req.kv_source else 0)
        req.num_computed_tokens = hit_tokens

    def _remote_loads(self, req: Request, hits: int, cacheable: int, fmt: BlockFormat) -> tuple[int, int]:
        """What a request with a KV source pulls after its `hits` cached blocks: full blocks (up to `cacheable`),
        and the positions of a migrated sequence's partial block when every block before it is there (its
        positions are all before the last token, which is computed here)."""
        source, bs = req.kv_source, self.blocks.block_size
        assert source is not None
        if fmt is not BlockFormat.FULL or not self.blocks.enable_prefix_caching:
            return 0, 0
        full = source.full_blocks(bs)
        loads = max(0, min(full, cacheable) - hits)
        partial = source.partial_tokens(bs)
        if not partial or hits + loads != full or full * bs + partial > req.num_tokens - 1:
            partial = 0
        return loads, partial

    def _load_from_remote(self, req: Request, first: int, keys: list[BlockHash], partial: int = 0) -> None:
        """New blocks after the request's cached prefix, filled by the plan's KV import from the producer replica
        (core/kv/leases.py) instead of being computed: full blocks (`keys`, registered), then `partial`
        positions of the next block (a migrated sequence's last block; not a cacheable block)."""
        assert req.kv_source is not None
        bt = self.blocks
        start = len(bt.blocks_of(req.req_id)) * bt.block_size
        written = bt.write(req.req_id, start, start + len(keys) * bt.block_size + partial)
        assert written is not None, "the fit check counted these blocks"
        self.leases.import_prefix(req.kv_source, first, list(written.added), keys)

    def _load_from_tiers(self, req: Request, keys: list[BlockHash]) -> None:
        """New blocks after the request's cached prefix, filled from the offload tiers by the plan's tier moves
        (like a swap-in) instead of being computed. Taking the blocks may offload others; none of these keys
        is displaced by that, so each is still where the lookup found it."""
        assert self.tiers is not None
        bt = self.blocks
        first = len(bt.blocks_of(req.req_id)) * bt.block_size
        with self.tiers.protecting(keys):
            written = bt.write(req.req_id, first, first + len(keys) * bt.block_size)
        assert written is not None, "the fit check counted these blocks"
        for key, block in zip(keys, written.added):
            self.tiers.load(key, block)
