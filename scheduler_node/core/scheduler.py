"""The scheduler: one rule for prefill, chunked prefill, prefix hits, resumption and decode.

Each request has `num_computed_tokens` and `num_tokens`; every step hands out tokens from a budget
(`max_num_batched_tokens`, `max_num_seqs`) so that the first catches up with the second. When blocks run out,
the policy's least valued running request is preempted (recompute, swap, or whichever is cheaper) and goes
back to waiting.

With P > 1 pipeline stages the engine keeps up to P plans in flight, each on requests that no other in-flight
plan holds: a request comes back only once its result is applied, so the scheduler knows the token it sampled
and hands it to every rank with the plan (only the output rank sampled it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proto.wire import CachedRequest, StepPlan, StepResult, TokenLogprobs
from scheduler_node.core.block_table import BlockTable
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import Policy
from scheduler_node.core.request import Request, Status

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


@dataclass(slots=True)
class _SentPlan:
    """What a plan in flight did to the scheduler's view, to apply or undo when its result comes back."""

    ends: dict[str, int] = field(default_factory=dict)  # each request's computed tokens once the step ran
    samplers: set[str] = field(default_factory=set)  # requests whose token this step samples


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        policy: Policy | None = None,
        num_host_blocks: int = 0,
        costs: PreemptionCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.policy = policy or Policy()
        self.blocks = BlockTable(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        self.costs = costs or PreemptionCosts()
        self.counters = SchedulerCounters()
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._on_worker: dict[str, int] = {}  # requests whose state the workers hold -> tokens the plans gave them
        self._disjoint_plans = config.pipeline_parallel_size > 1
        self._in_flight: set[str] = set()  # with disjoint plans: requests of plans whose results are not applied
        self._pending_new_blocks: dict[str, list[int]] = {}
        self._pending_updates: dict[str, list[tuple[int, int]]] = {}
        self._finished_ids: list[str] = []  # to tell the workers in the next plan
        self._preempted_ids: list[str] = []
        self._sent: dict[int, _SentPlan] = {}
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
        self._forget_on_worker(req, self._finished_ids)
        return req

    def resize(self, num_blocks: int) -> int:
        """Change the usable KV blocks at run time; returns how many live blocks move (on the next step)."""
        return self._queue_updates(self.blocks.resize(num_blocks))

    @property
    def has_work(self) -> bool:
        ops = self.blocks.ops
        pending_ops = bool(ops.copy or ops.swap_out or ops.swap_in)
        return bool(self.waiting or self.running or self._finished_ids or self._preempted_ids or pending_ops)

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
        to_schedule = [r for r in self.policy.order_running(self.running, now) if r.req_id not in self._in_flight]
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
        self._attach_diffs(plan)
        return plan

    def _seats_per_plan(self) -> int:
        """Requests one plan may hold. With P stages, a 1/P share of what can run at once: a plan that took
        every request would leave the next one empty and the stages back in lock-step, for good."""
        p = self.config.pipeline_parallel_size
        if p == 1:
            return self.config.max_num_seqs
        runnable = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-runnable // p))

    def _tokens_to_schedule(self, req: Request) -> int:
        """Tokens to compute: up to the known ones plus the sampled ones still in flight (async
        scheduling), never past max_tokens."""
        if len(req.output_token_ids) + req.num_placeholders >= req.stop.max_tokens:
            return 0
        return req.num_tokens + req.num_placeholders - req.num_computed_tokens

    def _displace_for_priority(self, now: float, budget: int) -> None:
        """Before the step: while the best waiting request finds no seat or no blocks, it displaces the
        least valued running request if it beats it by the policy's margin."""
        candidates = (r for r in self.waiting if r.req_id not in self._in_flight)
        head = min(candidates, key=lambda r: self.policy.sort_key(r, now), default=None)
        while head is not None and not self._fits(head, budget):
            victim = self.policy.pick_victim(self.running, now)
            if victim is None or not self.policy.displaces(head, victim, now):
                return
            logger.info("%s displaces %s by priority", head.req_id, victim.req_id)
            self._preempt(victim)

    def _fits(self, req: Request, budget: int) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.swapped:
            need = self.blocks.blocks_for(req.num_computed_tokens + n)
        else:
            need = self.blocks.blocks_needed(req.req_id, req.num_computed_tokens, req.num_computed_tokens + n)
        return need + self._watermark_blocks <= self.blocks.num_free

    @property
    def _watermark_blocks(self) -> int:
        return int(self.config.watermark * self.blocks.usable_blocks)

    def _prefill_floor(self, now: float) -> float:
        """Prefill below this effective priority waits a step: when a request that outranks others by the
        policy's margin has prompt tokens to compute, their prefill chunks would only lengthen its step (and
        its time to first token). Decodes always run. -inf when no such gap exists (always under fcfs)."""
        if self.policy.preemption_margin <= 0:
            return float("-inf")
        pending = [r for r in self.waiting if r.req_id not in self._in_flight]
        pending += [r for r in self.running if r.req_id not in self._in_flight and self._tokens_to_schedule(r) > 1]
        if not pending:
            return float("-inf")
        return max(self.policy.effective_priority(r, now) for r in pending) - self.policy.preemption_margin

    def _admit(self, budget: int, seats: int, floor: float, plan: StepPlan, now: float) -> None:
        for req in self.policy.order_waiting(self.waiting, now):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or len(plan.num_scheduled_tokens) >= seats:
                break
            if self.policy.effective_priority(req, now) < floor:
                break  # waiting is in policy order: the rest rank lower still
            if req.req_id in self._in_flight:
                continue  # preempted while its plan runs: it comes back once that result is applied
            if not self._claim_blocks(req, budget):
                break  # strict order: a big request at the head is not overtaken forever
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            n = min(self._tokens_to_schedule(req), budget)
            self._take(req, n, plan)
            budget -= n

    def _claim_blocks(self, req: Request, budget: int) -> bool:
        """Bring back a swapped request's blocks, or look up a new one's prefix; False if it does not fit."""
        bt = self.blocks
        if req.swapped:
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            growth = bt.blocks_for(req.num_computed_tokens + n) - len(bt.host_blocks_of(req.req_id))
            if not bt.can_swap_in(req.req_id, reserve=max(0, growth) + self._watermark_blocks):
                return False
            bt.swap_in(req.req_id)
            req.swapped = False
            return True
        if bt.blocks_of(req.req_id):  # a fork: it already shares its parent's prompt blocks
            first = req.num_computed_tokens
            return bt.can_write(req.req_id, first, first + min(req.num_tokens - first, budget), self._watermark_blocks)
        hashes = req.update_block_hashes(bt.block_size)
        hits = bt.match_prefix(hashes[: (req.num_tokens - 1) // bt.block_size])  # the last token is recomputed
        hit_tokens = len(hits) * bt.block_size
        n = min(req.num_tokens - hit_tokens, budget)
        reused_free = sum(1 for b in hits if bt.is_free(b))
        if bt.blocks_for(hit_tokens + n) - len(hits) + reused_free + self._watermark_blocks > bt.num_free:
            return False
        if req.num_preemptions == 0 and not req.output_token_ids:  # new prompts only: resumptions would inflate it
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += hit_tokens
        bt.acquire(req.req_id, hits)
        req.num_computed_tokens = hit_tokens
        return True

    def _take(self, req: Request, n: int, plan: StepPlan) -> None:
        first = req.num_computed_tokens
        added, replaced = self.blocks.write(req.req_id, first, first + n)
        if req.req_id in self._on_worker:
            self._pending_new_blocks.setdefault(req.req_id, []).extend(added)
            self._pending_updates.setdefault(req.req_id, []).extend(replaced)
            plan.cached_requests.append(CachedRequest(req.req_id, [], first, self._tokens_workers_lack(req)))
        else:
            plan.new_requests.append(req.to_new_request(self.blocks.blocks_of(req.req_id)))
        self._on_worker[req.req_id] = req.num_tokens
        if self._disjoint_plans:
            self._in_flight.add(req.req_id)
        plan.num_scheduled_tokens[req.req_id] = n
        req.num_computed_tokens += n
        sent = self._sent.setdefault(plan.step_id, _SentPlan())
        sent.ends[req.req_id] = req.num_computed_tokens
        if req.num_computed_tokens == req.num_tokens + req.num_placeholders:
            req.num_placeholders += 1  # this step samples a token the scheduler learns of later
            sent.samplers.add(req.req_id)

    def _tokens_workers_lack(self, req: Request) -> list[int]:
        """With disjoint plans: the tokens sampled since the workers last saw `req` (only the output rank saw
        them). With one stage every rank appends its own samples, which async scheduling does not know yet."""
        if not self._disjoint_plans:
            return []
        return req.output_token_ids[self._on_worker[req.req_id] - len(req.prompt_token_ids) :]

    def _attach_diffs(self, plan: StepPlan) -> None:
        for cached in plan.cached_requests:
            cached.new_block_ids = self._pending_new_blocks.pop(cached.req_id, [])
        plan.block_updates = {r: u for r, u in self._pending_updates.items() if r in self._on_worker}
        self._pending_updates = {}
        ops = self.blocks.take_ops()
        plan.swap_out, plan.block_copies, plan.swap_in = ops.swap_out, ops.copy, ops.swap_in
        plan.finished_req_ids, self._finished_ids = self._finished_ids, []
        plan.preempted_req_ids, self._preempted_ids = self._preempted_ids, []

    def _preempt(self, req: Request) -> None:
        mode = self._preemption_mode(req)
        tokens = req.num_computed_tokens
        req.num_placeholders = 0  # in-flight tokens of a preempted request are dropped and sampled again
        if mode == "swap":
            blocks = self.blocks.swap_out(req.req_id)
            req.swapped = True
            # positions past the known tokens held in-flight samples; at least the last token is recomputed
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.counters.preemptions_swap += 1
        else:
            blocks = self.blocks.free(req.req_id)
            req.num_computed_tokens = 0
            self.counters.preemptions_recompute += 1
        self._forget_on_worker(req, self._preempted_ids)
        logger.info("preempted %s by %s: %d tokens, %d blocks", req.req_id, mode, tokens, blocks)
        self.running.remove(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.waiting.append(req)

    def _preemption_mode(self, req: Request) -> str:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.blocks.can_swap_out(req.req_id):
            return "recompute"  # swap space full: fall back
        if mode == "swap":
            return "swap"
        swap = self.costs.swap_ms(len(self.blocks.blocks_of(req.req_id)))
        return "swap" if swap < self.costs.recompute_ms(req) else "recompute"

    def _forget_on_worker(self, req: Request, notice: list[str]) -> None:
        self._pending_new_blocks.pop(req.req_id, None)
        self._pending_updates.pop(req.req_id, None)
        if self._on_worker.pop(req.req_id, None) is not None:
            notice.append(req.req_id)

    def _maybe_compact(self) -> None:
        interval = self.config.compaction_interval
        if not interval or self._step_id % interval:
            return
        start = time.perf_counter()
        moved = self._queue_updates(self.blocks.compact(max_moves=self.config.compaction_max_moves))
        self.counters.compaction_moves += moved
        self.counters.compaction_seconds += time.perf_counter() - start

    def _queue_updates(self, updates: dict[str, list[tuple[int, int]]]) -> int:
        for req_id, changes in updates.items():
            self._pending_updates.setdefault(req_id, []).extend(changes)
        return sum(len(c) for c in updates.values())

    # ---- results

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Register computed blocks for prefix caching, append sampled tokens, apply stop conditions."""
        sent = self._sent.pop(plan.step_id, _SentPlan())
        if result.interrupted:
            self._undo(plan, sent)
            return []
        self.costs.observe(result.execute_ms, plan.total_tokens)
        if plan.num_scheduled_tokens:
            self.counters.steps += 1
            self.counters.worker_idle_ms += result.idle_ms
        for req_id in plan.num_scheduled_tokens:
            self._in_flight.discard(req_id)
            req = self.requests.get(req_id)
            if req is not None and req.status is Status.RUNNING and req_id in sent.ends:
                # This step's own end, not num_computed_tokens: that counts plans still in flight, whose
                # blocks are not written yet (and are never written if those plans are interrupted).
                full = sent.ends[req_id] // self.blocks.block_size
                self.blocks.register(req_id, req.update_block_hashes(self.blocks.block_size)[:full])
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

    def _undo(self, plan: StepPlan, sent: _SentPlan) -> None:
        """The workers skipped this plan's compute: its requests are back where they were before it (the
        blocks it allocated stay theirs; its diffs and block operations did run)."""
        self.counters.interrupted_steps += 1
        for req_id, n in plan.num_scheduled_tokens.items():
            self._in_flight.discard(req_id)
            req = self.requests.get(req_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # finished or preempted since: nothing of this step is kept for it
            req.num_computed_tokens -= n
            if req_id in sent.samplers:
                req.num_placeholders -= 1

    def may_interrupt(self, req: Request, plans: list[StepPlan]) -> bool:
        """May `req` have the workers skip these plans in flight? When it outranks every request in them by the
        policy's margin (never under fcfs) and `can_undo` them."""
        if not self.can_undo(plans):
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
            self._forget_on_worker(req, self._preempted_ids)
            req.num_computed_tokens = 0
            req.num_placeholders = 0
            req.swapped = False
        old = self.blocks
        self.blocks = BlockTable(old.num_blocks, old.block_size, old.enable_prefix_caching, old.num_host_blocks)
        self.blocks.resize(old.usable_blocks)
        self._pending_updates = {}
        self._in_flight.clear()  # the engine dropped every plan in flight
        self._sent.clear()
        return len(running)
