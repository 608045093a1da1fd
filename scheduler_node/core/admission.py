"""Admission: which waiting requests start in a step (policy order, budget, seats, blocks and prefix hits, the
offload tiers, KV precision), the prefill floor that keeps low-priority prefill out of a high-priority request's
way, and displacement of running requests by a waiting one that outranks them."""

from __future__ import annotations

import logging
from collections.abc import Callable

from proto.wire import StepPlan
from scheduler_node.core.block_table import BlockHash
from scheduler_node.core.in_flight import SentPlan
from scheduler_node.core.kv_precision import BlockFormat, choose_format
from scheduler_node.core.preemption import Preemption
from scheduler_node.core.request import Request, Status

logger = logging.getLogger(__name__)


class Admission(Preemption):
    def _waiting_head(self, now: float) -> Request | None:
        """The waiting request the policy ranks first, leaving out those held by a plan in flight."""
        candidates = (r for r in self.waiting if not self.in_flight.held(r.handle) and not r.pulling)
        if self.policy.stable_order:
            return next(candidates, None)  # waiting is in the policy's order
        return min(candidates, key=lambda r: self.policy.sort_key(r, now), default=None)

    def _displace_for_priority(self, now: float, budget: int) -> None:
        """Before the step: while the best waiting request finds no seat or no blocks, it displaces the
        least valued running request if it beats it by the policy's margin."""
        head = self._waiting_head(now)
        while head is not None and not self._fits(head, budget):
            victim = self._pick_victim(self.running, now)
            if victim is None or not self.policy.displaces(head, victim, now):
                return
            logger.info("%s displaces %s by priority", head.req_id, victim.req_id)
            self._preempt(victim)

    def _fits(self, req: Request, budget: int) -> bool:
        """Would a waiting request get a seat and its blocks now (prefix-cache hits counted)?"""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        need, _, _, fmt = self._blocks_to_start(req, budget)
        return need + self._watermark(fmt) <= self.blocks.num_free_of(fmt)

    def _blocks_to_start(self, req: Request, budget: int) -> tuple[int, list[int], int, BlockFormat]:
        """Free blocks a waiting request takes to start its next chunk, the cached blocks it would reuse, how
        many blocks after those it would load from the offload tiers (into new blocks) instead of computing, and
        the format of its blocks (one that holds blocks keeps theirs; a new one's is chosen: core/kv_precision.py).

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

        starts: dict[BlockFormat, tuple[int, list[int], int, BlockFormat]] = {}

        def start(fmt: BlockFormat) -> tuple[int, list[int], int, BlockFormat]:
            """What starting in this format takes; worked out once per format (the choice below asks too)."""
            if fmt not in starts:
                hits = bt.match_prefix(hashes[:cacheable], fmt)
                tiers = self.tiers if fmt is BlockFormat.FULL else None  # the tiers hold full blocks
                loads = tiers.match(hashes[len(hits) : cacheable]) if tiers is not None else 0
                partial = 0
                if req.kv_source is not None:  # pulled from another replica instead (core/kv_handoff.py)
                    loads, partial = self._remote_loads(req, len(hits), cacheable, fmt)
                hit_tokens = (len(hits) + loads) * bt.block_size + partial
                n = min(req.num_tokens - hit_tokens, budget)
                reused_free = sum(1 for b in hits if bt.is_free(b))
                starts[fmt] = bt.blocks_for(hit_tokens + n) - len(hits) + reused_free, hits, loads, fmt
            return starts[fmt]

        def left(fmt: BlockFormat) -> int:
            if fmt is BlockFormat.COMPACT and bt.blocks_for(req.num_tokens_at_most) > bt.num_compact_blocks:
                return -1  # it could never finish there (it would be preempted, come back compact, and again)
            return bt.num_free_of(fmt) - self._watermark(fmt) - start(fmt)[0]

        fmt = choose_format(
            req.kv_precision, req.priority, self.precision, bt.num_compact_blocks > 0, left, bt.usable_blocks
        )
        return start(fmt)

    def _watermark(self, fmt: BlockFormat) -> int:
        """Blocks admission keeps free for the running requests to grow into; none when nothing runs: a request
        that needs the whole cache would otherwise never start."""
        if not self.running:
            return 0
        pool = self.blocks.num_compact_blocks if fmt is BlockFormat.COMPACT else self.blocks.usable_blocks
        return int(self.config.watermark * pool)

    def _prefill_floor(self, now: float) -> float:
        """Prefill below this effective priority waits a step: when a request that outranks others by the
        policy's margin has prompt tokens to compute, their prefill chunks would only lengthen its step (and
        its time to first token). Decodes always run. -inf when no such gap exists (always under fcfs)."""
        if self.policy.preemption_margin <= 0:
            return float("-inf")
        held = self.in_flight.held
        if self.policy.stable_order:
            head = self._waiting_head(now)  # the waiting request of the highest effective priority
            pending = [head] if head is not None else []
        else:
            pending = [r for r in self.waiting if not held(r.handle)]
        for req in list(self._catching_up):
            if req.status is not Status.RUNNING or self._tokens_to_schedule(req) <= 1:
                self._catching_up.discard(req)  # caught up: only an interrupt's rollback brings it back
            elif not held(req.handle):
                pending.append(req)
        if not pending:
            return float("-inf")
        return max(self.policy.effective_priority(r, now) for r in pending) - self.policy.preemption_margin

    def _admit(
        self,
        budget: int,
        seats: int,
        floor: float,
        plan: StepPlan,
        sent: SentPlan,
        now: float,
        excluded: Callable[[Request], bool] | None = None,
    ) -> None:
        """Start waiting requests in policy order while budget, seats and blocks last. Forks (n > 1) that wait
        while holding their parent's prompt blocks go first: left waiting, they would keep those blocks from a
        request that needs the whole cache, which would then preempt itself over and over. When nothing runs and
        none of them can start, they let go one by one until one does (or none holds blocks): a step that starts
        nothing while nothing runs would leave the engine nothing to wait for."""
        while (holders := self._admit_pass(budget, seats, floor, plan, sent, now, excluded)) and not self.running:
            self._release_blocks(holders[-1])  # nothing started: the budget and seats are as they were

    def _admit_pass(
        self,
        budget: int,
        seats: int,
        floor: float,
        plan: StepPlan,
        sent: SentPlan,
        now: float,
        excluded: Callable[[Request], bool] | None = None,
    ) -> list[Request]:
        """One pass over the waiting queue (see `_admit`); returns the waiting requests that hold blocks."""
        if not self._room(budget, seats, sent):
            return []  # nothing can start: the queue is not even looked at (something runs, so no fork must let go)
        ordered = list(self.waiting) if self.policy.stable_order else self.policy.order_waiting(self.waiting, now)
        # A migrated sequence pulling its KV holds blocks too, but starts only once its pull is done (`pulling`).
        holders = [r for r in ordered if not r.swapped and not r.pulling and self.blocks.blocks_of(r.req_id)]
        holding = set(holders)
        for req in holders + [r for r in ordered if r not in holding]:
            if not self._room(budget, seats, sent):
                break
            if req.pulling or (excluded is not None and excluded(req)):
                continue  # (a suspect outside its own step, or another request in a suspect's step: quarantine.py)
            holds_blocks = req in holding
            if self.policy.effective_priority(req, now) < floor:
                if not holds_blocks:
                    break  # waiting is in policy order: the rest rank lower still
                if req.output_token_ids:
                    continue  # a migrated sequence holding its KV (no fork has outputs): it yields to a class above
            if self.in_flight.held(req.handle):
                continue  # preempted while its plan runs: it comes back once that result is applied
            if req.lora is not None and not self.view.lora_slots.fits(req.lora):
                continue  # every LoRA slot is pinned by running requests: it waits, the others pass
            if not self._claim_blocks(req, budget):
                if holds_blocks:
                    continue
                break  # strict order: a big request at the head is not overtaken forever
            self._start_running(req)
            todo = self._tokens_to_schedule(req)
            n = min(todo, budget)
            written = self.blocks.write(req.req_id, req.num_computed_tokens, req.num_computed_tokens + n)
            if written is None:
                raise RuntimeError(f"{req.req_id}: its blocks were claimed, yet they do not fit")
            self._take(req, n, n == todo, plan, sent, written)
            budget -= n
        return holders

    def _room(self, budget: int, seats: int, sent: SentPlan) -> bool:
        """Can one more request start in this plan?"""
        return budget > 0 and len(self.running) < self.config.max_num_seqs and len(sent.requests) < seats

    def _release_blocks(self, req: Request) -> None:
        """Nothing runs, and forks waiting on shared blocks cannot start (each needs a free block to copy the
        shared last block, and they hold the whole cache): the least valued one lets go of its blocks and will
        compute its prompt again (from the prefix cache where it can); the others then write in place."""
        logger.info("%s releases its shared blocks: nothing runs and no fork can start", req.req_id)
        self.blocks.free(req.req_id)
        req.num_computed_tokens = 0
        self.counters.preemptions_recompute += 1

    def _claim_blocks(self, req: Request, budget: int) -> bool:
        """Take the blocks a waiting request needs to start (see `_blocks_to_start`); False if they are short."""
        bt = self.blocks
        need, hits, loads, fmt = self._blocks_to_start(req, budget)
        if need + self._watermark(fmt) > bt.num_free_of(fmt):
            return False
        if req.swapped:
            bt.swap_in(req.req_id)
            req.swapped = False
            # Its computed blocks are back (the swap-in runs before this step reads them) under new block ids.
            bt.register(req.req_id, req.update_block_hashes(bt.block_size), 0, req.num_computed_tokens // bt.block_size)
        elif not bt.blocks_of(req.req_id):
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
                    if req.migrated_in:  # its import's result settles it (`Results._settle_pulls`)
                        self._pulls.append((req, self.leases.imports[-1]))
                else:
                    self._load_from_tiers(req, hashes[len(hits) : len(hits) + loads])
                bt.register(req.req_id, hashes[: len(hits) + loads])
            if req.migrated_in:
                self._count_migration(req, hit_tokens, loads * bt.block_size + partial if req.kv_source else 0)
            req.num_computed_tokens = hit_tokens
        req.kv_source = None  # used once: a request that recomputes later computes its prompt here
        return True

    def _count_migration(self, req: Request, ready: int, imported: int) -> None:
        """A migrated sequence starts here with `ready` positions' KV in place, `imported` of them pulled from its
        source: an import when they cover what its source held (the prefix cache may hold some), else a recompute."""
        req.migrated_in = False  # once: a later preemption recomputes it as any request
        source = req.kv_source
        if source is not None and source.tokens and ready >= source.tokens:
            self.counters.migrations_imported += 1
            req.migration_imports = True
        else:
            self.counters.migrations_recomputed += 1
            if source is None:
                why = "its source offered no KV (no exporter there, or it held no device blocks)"
            else:  # another KV format here, prefix caching off, or a layout whose partial block does not fit
                why = f"{ready} of the {source.tokens} positions its source holds can be imported here"
            logger.info("%s: migrated in, recomputes: %s", req.req_id, why)
        self.counters.migration_kv_tokens_imported += imported

    def _pin_arrivals(self) -> None:
        """Migrated sequences that arrived with their KV leased on the source and did not start in this plan claim
        their blocks now and pull their KV with this plan, seat or no seat: the source's lease lasts seconds and a
        seat here may take longer (every seat held by long runs), and an Abort from the router, once a sibling
        (n > 1) answered, releases it too. Holding its blocks, a sequence starts before waiting requests that hold
        none (`_admit_pass`), as a preempted one resumes before new ones. Without blocks now (admission's fit
        rule, the watermark kept), it tries again each step; its lease may run out meanwhile: it then recomputes."""
        for req, told in list(self._arrivals.items()):
            if self._by_handle.get(req.handle) is not req or req.kv_source is None:
                del self._arrivals[req]  # ended, or started (admission pulled its KV in that plan)
            elif self._claim_blocks(req, self.config.max_num_batched_tokens):
                del self._arrivals[req]
                req.pulling = bool(self._pulls) and self._pulls[-1][0] is req
            elif not told:
                self._arrivals[req] = True
                logger.info("%s: migrated in, no free blocks to pull its KV into yet: it tries each step", req.req_id)

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
        (core/kv_handoff.py) instead of being computed: full blocks (`keys`, registered), then `partial`
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
