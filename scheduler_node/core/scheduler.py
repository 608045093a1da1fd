"""The scheduler: one rule for prefill, chunked prefill, prefix hits, resumption and decode.

Each request has `num_computed_tokens` and `num_tokens`; every step hands out tokens from a budget
(`max_num_batched_tokens`, `max_num_seqs`) so that the first catches up with the second. When blocks run out,
the policy's least valued running request is preempted (recompute, swap, or whichever is cheaper) and goes
back to waiting.

How plans flow (the execution mode) is decided once from the world: with P > 1 pipeline stages the engine keeps
up to P plans in flight, each on requests that no other in-flight plan holds, and a request comes back only once
its result is applied, so the scheduler knows the token it sampled and hands it to every rank with the plan. Two
helpers keep the rest: the workers' view (what each plan must tell the workers) and the in-flight ledger (what
each plan did, to apply or undo it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proto.wire import ExecutionMode, StepPlan, StepResult, TokenLogprobs
from scheduler_node.core.block_table import BlockHash, BlockTable
from scheduler_node.core.config import PreemptionMode, SchedulerConfig
from scheduler_node.core.in_flight import InFlightLedger, SentPlan
from scheduler_node.core.kv_tiers import KVTiers
from scheduler_node.core.policy import Policy
from scheduler_node.core.request import Request, Status
from scheduler_node.core.worker_view import WorkerView

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class PreemptionCosts:
    """What elastic preemption weighs: recomputing a victim's tokens vs moving its blocks out and back."""

    ms_per_token: float = 1.0  # refreshed from the workers' step timings
    bytes_per_block: int = 0
    swap_bytes_per_s: float = 0.0  # 0: unknown, swap is never assumed cheaper

    def recompute_ms(self, req: Request) -> float:
        return req.num_computed_tokens * self.ms_per_token

    def swap_ms(self, num_blocks: int) -> float:
        if self.swap_bytes_per_s <= 0:
            return float("inf")
        return 2 * num_blocks * self.bytes_per_block / self.swap_bytes_per_s * 1e3

    def observe(self, execute_ms: float, num_tokens: int) -> None:
        if num_tokens > 0 and execute_ms > 0:
            self.ms_per_token = 0.9 * self.ms_per_token + 0.1 * execute_ms / num_tokens


@dataclass(slots=True)
class SchedulerCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    compaction_moves: int = 0
    compaction_seconds: float = 0.0
    steps: int = 0
    worker_idle_ms: float = 0.0  # summed over steps: the gap the workers waited between steps
    interrupted_steps: int = 0  # steps whose compute was skipped for a request that outranked them
    scheduled_tokens: int = 0  # tokens computed by the workers, recomputation included


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        policy: Policy | None = None,
        mode: ExecutionMode | None = None,
        num_host_blocks: int = 0,
        costs: PreemptionCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
        tiers: KVTiers | None = None,
    ) -> None:
        self.config = config
        self.mode = mode or ExecutionMode()
        self.clock = clock
        self.policy = policy or Policy()
        self.blocks = BlockTable(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        self.tiers = tiers if tiers is not None and tiers.enabled and config.enable_prefix_caching else None
        self._attach_tiers()
        self.costs = costs or PreemptionCosts()
        self.counters = SchedulerCounters()
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.view = WorkerView(self.mode.tokens_in_plan)
        self.in_flight = InFlightLedger(self.mode.disjoint_plans)
        self._step_id = 0

    @property
    def num_preemptions(self) -> int:
        return self.counters.preemptions_recompute + self.counters.preemptions_swap

    # ---- queue management

    def add(self, req: Request, forks: list[Request] | None = None) -> None:
        """Queue a request; `forks` (n > 1) start from its prompt's blocks once the prompt is computed."""
        for r in [req, *(forks or [])]:
            if r.req_id in self.requests:
                raise KeyError(f"request {r.req_id!r} is already live")
        req.forks = list(forks or [])
        for r in [req, *req.forks]:
            self.requests[r.req_id] = r
        self.waiting.append(req)

    def finish(self, req_id: str, status: Status) -> Request | None:
        """End a live request (abort, stop string, error) and free its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.finished:
            req.status = status
        self.blocks.free(req.req_id)
        self.view.forget(req.req_id, preempted=False)
        return req

    def resize(self, num_blocks: int) -> int:
        """Change the usable KV blocks at run time; returns how many live blocks move (on the next step)."""
        return self.view.replace_blocks(self.blocks.resize(num_blocks))

    @property
    def has_work(self) -> bool:
        ops = self.blocks.ops
        pending_ops = bool(ops.copy or ops.swap_out or ops.swap_in)
        return bool(self.waiting or self.running or self.view.has_notices or pending_ops)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step

    def schedule(self) -> StepPlan:
        self._step_id += 1
        now = self.clock()
        self._maybe_compact()
        plan = StepPlan(self._step_id)
        budget = self.config.max_num_batched_tokens
        seats = self._seats_per_plan()
        self._displace_for_priority(now, budget)
        floor = self._prefill_floor(now)
        preempted = False
        to_schedule = [r for r in self.policy.order_running(self.running, now) if not self.in_flight.held(r.req_id)]
        while to_schedule and budget > 0 and len(plan.num_scheduled_tokens) < seats:
            req = to_schedule.pop(0)
            n = min(self._tokens_to_schedule(req), budget)
            if n <= 0 or (n > 1 and self.policy.effective_priority(req, now) < floor):
                continue
            first = req.num_computed_tokens
            while not self.blocks.can_write(req.req_id, first, first + n):
                victim = self.policy.pick_victim(to_schedule, now) or req
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                to_schedule.remove(victim)
            else:
                self._take(req, n, plan)
                budget -= n
        if not preempted:
            self._admit(budget, seats, floor, plan, now)
        self.view.finish_plan(plan, self.blocks.take_ops())
        if self.tiers is not None:
            plan.tier_moves = self.tiers.take_moves()
        return plan

    def _attach_tiers(self) -> None:
        """Cached blocks the device pool hands out again go to the offload tiers (when there are any)."""
        if self.tiers is not None:
            self.blocks.on_evict = self.tiers.offload

    def _seats_per_plan(self) -> int:
        """Requests one plan may hold. With disjoint plans, a 1/N share of what can run at once for N plans in
        flight: a plan that took every request would leave the next one empty and the stages in lock-step."""
        if not self.mode.disjoint_plans:
            return self.config.max_num_seqs
        runnable = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-runnable // self.mode.plans_in_flight))

    def _tokens_to_schedule(self, req: Request) -> int:
        """Tokens to compute: up to the known ones plus the sampled ones still in flight (async
        scheduling), never past max_tokens."""
        if len(req.output_token_ids) + req.num_placeholders >= req.stop.max_tokens:
            return 0
        return req.num_tokens + req.num_placeholders - req.num_computed_tokens

    def _displace_for_priority(self, now: float, budget: int) -> None:
        """Before the step: while the best waiting request finds no seat or no blocks, it displaces the
        least valued running request if it beats it by the policy's margin."""
        candidates = (r for r in self.waiting if not self.in_flight.held(r.req_id))
        head = min(candidates, key=lambda r: self.policy.sort_key(r, now), default=None)
        while head is not None and not self._fits(head, budget):
            victim = self.policy.pick_victim(self.running, now)
            if victim is None or not self.policy.displaces(head, victim, now):
                return
            logger.info("%s displaces %s by priority", head.req_id, victim.req_id)
            self._preempt(victim)

    def _fits(self, req: Request, budget: int) -> bool:
        """Would a waiting request get a seat and its blocks now (prefix-cache hits counted)?"""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return self._blocks_to_start(req, budget)[0] + self._watermark_blocks <= self.blocks.num_free

    def _blocks_to_start(self, req: Request, budget: int) -> tuple[int, list[int], int]:
        """Free blocks a waiting request takes to start its next chunk, the cached blocks it would reuse, and how
        many blocks after those it would load from the offload tiers (into new blocks) instead of computing.

        The one fit check of admission and displacement: a swapped request brings its blocks back, a fork (n > 1)
        writes into its shared prompt blocks, a new or recomputed one reuses its longest cached prefix (a cached
        block on the free list counts against the free blocks, since taking it removes it from there)."""
        bt = self.blocks
        first = req.num_computed_tokens
        if req.swapped:
            n = min(req.num_tokens - first, budget)
            return max(bt.blocks_for(first + n), len(bt.host_blocks_of(req.req_id))), [], 0
        if bt.blocks_of(req.req_id):
            return bt.blocks_needed(req.req_id, first, first + min(req.num_tokens - first, budget)), [], 0
        hashes = req.update_block_hashes(bt.block_size)
        cacheable = (req.num_tokens - 1) // bt.block_size  # the last token is recomputed
        if req.sampling.prompt_logprobs is not None and not req.prompt_logprobs_done:
            cacheable = 0  # a cached prefix has no logits: the prompt is computed in full to score every token
        hits = bt.match_prefix(hashes[:cacheable])
        loads = self.tiers.match(hashes[len(hits) : cacheable]) if self.tiers is not None else 0
        hit_tokens = (len(hits) + loads) * bt.block_size
        n = min(req.num_tokens - hit_tokens, budget)
        reused_free = sum(1 for b in hits if bt.is_free(b))
        return bt.blocks_for(hit_tokens + n) - len(hits) + reused_free, hits, loads

    @property
    def _watermark_blocks(self) -> int:
        return int(self.config.watermark * self.blocks.usable_blocks)

    def _prefill_floor(self, now: float) -> float:
        """Prefill below this effective priority waits a step: when a request that outranks others by the
        policy's margin has prompt tokens to compute, their prefill chunks would only lengthen its step (and
        its time to first token). Decodes always run. -inf when no such gap exists (always under fcfs)."""
        if self.policy.preemption_margin <= 0:
            return float("-inf")
        held = self.in_flight.held
        pending = [r for r in self.waiting if not held(r.req_id)]
        pending += [r for r in self.running if not held(r.req_id) and self._tokens_to_schedule(r) > 1]
        if not pending:
            return float("-inf")
        return max(self.policy.effective_priority(r, now) for r in pending) - self.policy.preemption_margin

    def _admit(self, budget: int, seats: int, floor: float, plan: StepPlan, now: float) -> None:
        """Start waiting requests in policy order while budget, seats and blocks last. Forks (n > 1) that wait
        while holding their parent's prompt blocks go first: left waiting, they would keep those blocks from a
        request that needs the whole cache, which would then preempt itself over and over."""
        ordered = self.policy.order_waiting(self.waiting, now)
        holders = [r for r in ordered if not r.swapped and self.blocks.blocks_of(r.req_id)]
        for req in holders + [r for r in ordered if r not in holders]:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or len(plan.num_scheduled_tokens) >= seats:
                break
            holds_blocks = req in holders
            if self.policy.effective_priority(req, now) < floor and not holds_blocks:
                break  # waiting is in policy order: the rest rank lower still
            if self.in_flight.held(req.req_id):
                continue  # preempted while its plan runs: it comes back once that result is applied
            if not self._claim_blocks(req, budget):
                if holds_blocks:
                    continue
                break  # strict order: a big request at the head is not overtaken forever
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            n = min(self._tokens_to_schedule(req), budget)
            self._take(req, n, plan)
            budget -= n
        if holders and not self.running:
            self._release_blocks(holders[-1])

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
        need, hits, loads = self._blocks_to_start(req, budget)
        if need + self._watermark_blocks > bt.num_free:
            return False
        if req.swapped:
            bt.swap_in(req.req_id)
            req.swapped = False
        elif not bt.blocks_of(req.req_id):
            hit_tokens = (len(hits) + loads) * bt.block_size
            if req.num_preemptions == 0 and not req.output_token_ids:  # new prompts only: resumptions inflate it
                self.counters.prefix_cache_queries += req.num_tokens
                self.counters.prefix_cache_hits += hit_tokens
            bt.acquire(req.req_id, hits)
            if loads:
                hashes = req.update_block_hashes(bt.block_size)
                self._load_from_tiers(req, hashes[len(hits) : len(hits) + loads])
                bt.register(req.req_id, hashes[: len(hits) + loads])
            req.num_computed_tokens = hit_tokens
        return True

    def _load_from_tiers(self, req: Request, keys: list[BlockHash]) -> None:
        """New blocks after the request's cached prefix, filled from the offload tiers by the plan's tier moves
        (like a swap-in) instead of being computed. Taking the blocks may offload others; none of these keys
        is displaced by that, so each is still where the lookup found it."""
        assert self.tiers is not None
        bt = self.blocks
        first = len(bt.blocks_of(req.req_id)) * bt.block_size
        with self.tiers.protecting(keys):
            added, _ = bt.write(req.req_id, first, first + len(keys) * bt.block_size)
        for key, block in zip(keys, added):
            self.tiers.load(key, block)

    def _take(self, req: Request, n: int, plan: StepPlan) -> None:
        first = req.num_computed_tokens
        added, replaced = self.blocks.write(req.req_id, first, first + n)
        if replaced and self.view.holds(req.req_id):  # a new request's table goes out whole, replacements included
            self.view.replace_blocks({req.req_id: replaced})
        self.view.add_to_plan(req, plan, first, self.blocks.blocks_of(req.req_id), added)
        plan.num_scheduled_tokens[req.req_id] = n
        req.num_computed_tokens += n
        samples = req.num_computed_tokens == req.num_tokens + req.num_placeholders
        if samples:
            req.num_placeholders += 1  # this step samples a token the scheduler learns of later
        self.in_flight.record(plan.step_id, req.req_id, req.num_computed_tokens, samples)

    def _preempt(self, req: Request) -> None:
        mode = self._preemption_mode(req)
        tokens = req.num_computed_tokens
        req.num_placeholders = 0  # in-flight tokens of a preempted request are dropped and sampled again
        if mode is PreemptionMode.SWAP:
            blocks = self.blocks.swap_out(req.req_id)
            req.swapped = True
            # positions past the known tokens held in-flight samples; at least the last token is recomputed
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.counters.preemptions_swap += 1
        else:
            blocks = self.blocks.free(req.req_id)
            req.num_computed_tokens = 0
            self.counters.preemptions_recompute += 1
        self.view.forget(req.req_id, preempted=True)
        logger.info("preempted %s by %s: %d tokens, %d blocks", req.req_id, mode.value, tokens, blocks)
        self.running.remove(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.waiting.append(req)

    def _preemption_mode(self, req: Request) -> PreemptionMode:
        mode = self.config.preemption_mode
        if mode is PreemptionMode.RECOMPUTE or not self.blocks.can_swap_out(req.req_id):
            return PreemptionMode.RECOMPUTE  # swap space full: fall back
        if mode is PreemptionMode.SWAP:
            return mode
        swap = self.costs.swap_ms(len(self.blocks.blocks_of(req.req_id)))
        return PreemptionMode.SWAP if swap < self.costs.recompute_ms(req) else PreemptionMode.RECOMPUTE

    def _maybe_compact(self) -> None:
        interval = self.config.compaction_interval
        if not interval or self._step_id % interval:
            return
        start = time.perf_counter()
        moved = self.view.replace_blocks(self.blocks.compact(max_moves=self.config.compaction_max_moves))
        self.counters.compaction_moves += moved
        self.counters.compaction_seconds += time.perf_counter() - start

    # ---- results

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Register computed blocks for prefix caching, append sampled tokens, apply stop conditions."""
        sent = self.in_flight.settle(plan.step_id, list(plan.num_scheduled_tokens))
        if result.interrupted:
            self._undo(plan, sent)
            return []
        self.costs.observe(result.execute_ms, plan.total_tokens)
        if self.tiers is not None:
            self.tiers.observe(result.tier_ms)
        if plan.num_scheduled_tokens:
            self.counters.steps += 1
            self.counters.worker_idle_ms += result.idle_ms
            self.counters.scheduled_tokens += plan.total_tokens
        for req_id in plan.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is not None and req.status is Status.RUNNING and req_id in sent.ends:
                # This step's own end, not num_computed_tokens: that counts plans still in flight, whose
                # blocks are not written yet (and are never written if those plans are interrupted).
                full = sent.ends[req_id] // self.blocks.block_size
                self.blocks.register(req_id, req.update_block_hashes(self.blocks.block_size)[:full])
        for req_id, (first, logprobs) in result.prompt_logprobs.items():
            if (req := self.requests.get(req_id)) is not None:  # kept even if preempted since: positions are checked
                req.add_prompt_logprobs(first, logprobs)
        outputs = []
        for req_id, token_ids in result.sampled.items():
            req = self.requests.get(req_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted or preempted while the step ran
            req.num_placeholders -= len(token_ids)
            kept = req.append_tokens(token_ids)
            if req.forks:
                self._start_forks(req)
            logprobs = result.logprobs.get(req_id, [])[: len(kept)]
            outputs.append(RequestOutput(req, kept, logprobs))
            if req.num_tokens >= self.config.max_model_len and not req.finished:
                req.status = Status.FINISHED_LENGTH
            if req.finished:
                self.finish(req_id, req.status)
        return outputs

    def _undo(self, plan: StepPlan, sent: SentPlan) -> None:
        """The workers skipped this plan's compute: its requests are back where they were before it (the
        blocks it allocated stay theirs; its diffs and block operations did run)."""
        self.counters.interrupted_steps += 1
        for req_id, n in plan.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # finished or preempted since: nothing of this step is kept for it
            req.num_computed_tokens -= n
            if req_id in sent.samplers:
                req.num_placeholders -= 1

    def may_interrupt(self, req: Request, plans: list[StepPlan]) -> bool:
        """May `req` have the workers skip these plans in flight? When it outranks every request in them by the
        policy's margin (never under fcfs) and `can_undo` them, in a world that can be interrupted."""
        if not self.mode.interruptible or not self.can_undo(plans):
            return False
        now = self.clock()
        others = [self.requests[r] for p in plans for r in p.num_scheduled_tokens if r in self.requests]
        return bool(others) and all(self.policy.displaces(req, other, now) for other in others)

    @staticmethod
    def can_undo(plans: list[StepPlan]) -> bool:
        """Plans whose compute can be skipped: none preempts or swaps (a swapped-out request keeps its computed
        tokens, which a skipped step would not have written)."""
        return not any(p.swap_out or p.swap_in or p.preempted_req_ids for p in plans)

    def _start_forks(self, parent: Request) -> None:
        """The prompt is computed: each sibling shares its blocks and recomputes only the last prompt token,
        so it samples its own first token; the shared last block is copied when first written."""
        prompt_len = len(parent.prompt_token_ids)
        for child in parent.forks:
            self.blocks.fork(parent.req_id, child.req_id, prompt_len)
            child.num_computed_tokens = prompt_len - 1
            self.waiting.append(child)
        parent.forks = []

    # ---- worker failure

    def requeue_all(self) -> int:
        """The workers' KV is gone (a rank was lost): every running request goes back to waiting, to be
        recomputed, swapped and forked ones drop their blocks too, and the prefix cache starts empty (the
        replacement worker's cache holds nothing). Returns how many requests were running."""
        running = list(self.running)
        for req in running:
            self.running.remove(req)
            req.status = Status.PREEMPTED
            req.num_preemptions += 1
            self.counters.preemptions_recompute += 1
            self.waiting.append(req)
        for req in self.requests.values():
            req.num_computed_tokens = 0
            req.num_placeholders = 0
            req.swapped = False
        self.view.forget_all()
        old = self.blocks
        self.blocks = BlockTable(old.num_blocks, old.block_size, old.enable_prefix_caching, old.num_host_blocks)
        self.blocks.resize(old.usable_blocks)
        if self.tiers is not None:
            self.tiers.clear()  # the replacement's tiers hold nothing the index could vouch for
        self._attach_tiers()
        self.in_flight.clear()  # the engine dropped every plan in flight
        return len(running)

    def fit_capacity(self, num_blocks: int, num_host_blocks: int) -> None:
        """The world came back holding fewer blocks than before (a replacement could not allocate the world's
        size): only that many are handed out from now on. Called on an empty table, right after `requeue_all`."""
        self.blocks.resize(min(num_blocks, self.blocks.usable_blocks))
        if num_host_blocks < self.blocks.num_host_blocks:
            bt = self.blocks
            self.blocks = BlockTable(bt.num_blocks, bt.block_size, bt.enable_prefix_caching, num_host_blocks)
            self.blocks.resize(bt.usable_blocks)
            self._attach_tiers()
