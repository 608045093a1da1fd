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

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proto.wire import ExecutionMode, KVGrant, StepPlan, StepResult, TokenLogprobs
from scheduler_node.core.block_table import BlockHash, BlockTable, Written
from scheduler_node.core.config import PreemptionMode, SchedulerConfig
from scheduler_node.core.in_flight import InFlightLedger, SentPlan
from scheduler_node.core.kv_events import DEVICE, KVEventSink
from scheduler_node.core.kv_handoff import KVLeases
from scheduler_node.core.kv_precision import BlockFormat, CompactKV, choose_format
from scheduler_node.core.kv_tiers import KVTiers
from scheduler_node.core.policy import Policy
from scheduler_node.core.request import FinishReason, Request, Status
from scheduler_node.core.speculator import Speculator
from scheduler_node.core.worker_view import WorkerView

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. The output side reads it on its own thread while the engine goes
    on changing the request: what ends it is copied here when it ends, and the rest of the request is only read
    for what no later step changes (its id, its prompt, its complete prompt logprobs)."""

    request: Request
    new_token_ids: list[int]  # the step's tokens (several with speculative decoding), up to the one that ended it
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set when these tokens ended it
    stopped_by_token: bool = False  # ended by eos or a stop token: the last token is not part of the text
    num_output_tokens: int = 0  # with finish_reason: all its output tokens
    cached_tokens: int = 0  # with finish_reason: of its prompt, found in the prefix cache
    embedding: list[float] | None = None  # with finish_reason, an embedding request's


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
        num_compact_blocks: int = 0,
        precision: CompactKV | None = None,
    ) -> None:
        self.config = config
        self.mode = mode or ExecutionMode()
        self.clock = clock
        self.policy = policy or Policy()
        self.blocks = BlockTable(
            num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks, num_compact_blocks
        )
        self.precision = precision or CompactKV()
        self.tiers = tiers if tiers is not None and tiers.enabled and config.enable_prefix_caching else None
        self.kv_events: KVEventSink | None = None  # set by attach_kv_events (a replica that publishes KV events)
        self._attach_tiers()
        self.costs = costs or PreemptionCosts()
        self.counters = SchedulerCounters()
        self.requests: dict[str, Request] = {}
        self._by_handle: dict[int, Request] = {}
        self._handles = itertools.count()  # never reused: a late result of a plan in flight names no one else
        # Kept in the policy's order when it is stable (the order of two requests never changes), else in arrival.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Running requests that may have more than one token to compute (admitted, or rolled back by an
        # interrupt): the only ones whose prefill can set the floor. Dropped once they caught up.
        self._catching_up: set[Request] = set()
        self.view = WorkerView(self.mode.tokens_in_plan, config.max_loras, config.max_cpu_loras)
        self.in_flight = InFlightLedger(self.mode.disjoint_plans)
        self._step_id = 0
        # Speculative decoding, when configured; not with tokens in plans (P > 1 stages): the stages before the
        # last would learn how many proposals were accepted only with the next plan.
        spec = config.speculative
        if spec is not None and self.mode.tokens_in_plan:
            logger.warning("speculative decoding is off: it does not run with pipeline parallelism yet")
            spec = None
        self.speculator = Speculator(spec) if spec is not None else None
        self.leases = KVLeases()  # disaggregated prefill/decode (core/kv_handoff.py)

    @property
    def num_preemptions(self) -> int:
        return self.counters.preemptions_recompute + self.counters.preemptions_swap

    # ---- queue management

    def add(self, req: Request, forks: list[Request] | None = None) -> None:
        """Queue a request; `forks` (n > 1) start from its prompt's blocks once the prompt is computed."""
        for r in [req, *(forks or [])]:
            if r.req_id in self.requests:
                raise KeyError(f"request {r.req_id!r} is already live")
        req.forks = tuple(forks or ())
        for r in [req, *req.forks]:
            r.handle = next(self._handles)
            if self.speculator is None:
                r.spec = None
            else:
                self.speculator.admit(r)
            self.requests[r.req_id] = r
            self._by_handle[r.handle] = r
        self._enqueue(req)

    def finish(self, req_id: str, status: Status) -> Request | None:
        """End a live request (abort, stop string, error) and free its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        del self._by_handle[req.handle]
        if req.status is Status.RUNNING or req.finished:  # finished by its own tokens: still in running
            self.running.remove(req)
            self._catching_up.discard(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.kv_lease:  # a prefill for another replica: its prompt's blocks wait under the lease for the pull
            ending = req.status if req.finished else status
            if ending in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH) and req.num_computed_tokens:
                self.leases.hold(self.blocks, req.req_id, req.kv_lease, self._prompt_blocks(req), self.clock())
            else:
                self.leases.revokes.append(req.kv_lease)
        if not req.finished:
            req.status = status
        self.blocks.free(req.req_id)
        self.view.forget(req, preempted=False)
        return req

    def request_of(self, handle: int) -> Request | None:
        """The live request a plan or a result names by this handle."""
        return self._by_handle.get(handle)

    def resize(self, num_blocks: int) -> int:
        """Change the usable KV blocks at run time; returns how many live blocks move (on the next step). Raises
        MemoryError, changing nothing, when live requests would not fit: their blocks, or any one of them at its
        longest (it would wait forever)."""
        stranded = self.stranded(num_blocks)
        if stranded:
            need, holds = max(r.num_tokens_at_most for r in stranded), self.max_model_len_for(num_blocks)
            raise MemoryError(
                f"{len(stranded)} live sequence(s) may grow to {need} tokens (prompt + max_tokens), more than "
                f"{num_blocks} block(s) hold ({holds} tokens): let them finish or abort them"
            )
        return self.view.replace_blocks(self._by_handles(self.blocks.resize(num_blocks)))

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + max_tokens) the cache holds now: the configured max_model_len, capped by
        the usable blocks (a ResizeCache shrink, a smaller replacement worker). Doors validate against it."""
        return self.max_model_len_for(self.blocks.usable_blocks)

    def max_model_len_for(self, usable_blocks: int) -> int:
        tokens = usable_blocks * self.blocks.block_size
        configured = self.config.max_model_len
        return min(configured, tokens) if configured else tokens

    def stranded(self, usable_blocks: int) -> list[Request]:
        """Live sequences that could never finish in that many usable blocks: validated against a longer
        max_model_len than those hold. Compact ones (kv_precision="compact") live in their own pool, which
        neither a resize nor a smaller replacement of the full blocks changes."""
        limit = self.max_model_len_for(usable_blocks)
        return [r for r in self.requests.values() if r.kv_precision != "compact" and r.num_tokens_at_most > limit]

    def _by_handles(self, updates: dict[str, list[tuple[int, int]]]) -> dict[int, list[tuple[int, int]]]:
        return {self.requests[req_id].handle: changes for req_id, changes in updates.items()}

    def _enqueue(self, req: Request) -> None:
        """Into waiting: in its place under a stable policy order (so no step sorts the queue), else at the end."""
        if self.policy.stable_order:
            now = self.clock()
            bisect.insort(self.waiting, req, key=lambda r: self.policy.sort_key(r, now))
        else:
            self.waiting.append(req)

    def _start_running(self, req: Request) -> None:
        self.waiting.remove(req)
        if self.policy.stable_order:
            now = self.clock()
            bisect.insort(self.running, req, key=lambda r: self.policy.sort_key(r, now))
        else:
            self.running.append(req)
        req.status = Status.RUNNING
        self._catching_up.add(req)

    @property
    def has_work(self) -> bool:
        ops = self.blocks.ops
        pending_ops = bool(ops.copy or ops.swap_out or ops.swap_in)
        return bool(self.waiting or self.running or self.view.has_notices or pending_ops or self.leases.pending)

    def _prompt_blocks(self, req: Request) -> int:
        """The blocks of a prompt that a prefix hit may reuse (its last token is always computed)."""
        return (len(req.prompt_token_ids) - 1) // self.blocks.block_size

    def expire_leases(self) -> list[str]:
        """Release the KV leases whose time is up (the engine's timer); their request ids."""
        return self.leases.expire(self.blocks, self.clock())

    def release_kv(self, request_id: str) -> bool:
        """Free a producer request's leased blocks (pulled, or its client gave up); False if none are held."""
        return self.leases.release(self.blocks, request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step

    def schedule(self) -> StepPlan:
        self._step_id += 1
        now = self.clock()
        self._maybe_compact()
        plan = StepPlan(self._step_id)
        sent = SentPlan()
        budget = self.config.max_num_batched_tokens
        seats = self._seats_per_plan()
        self._displace_for_priority(now, budget)
        floor = self._prefill_floor(now)
        preempted = False
        order = list(self.running) if self.policy.stable_order else self.policy.order_running(self.running, now)
        spec = self.speculator
        if spec is not None:
            spec.begin_step(len(self.running))
        # Speculating requests are held while their plan is in flight (their next tokens are not known before).
        holds = self.mode.disjoint_plans or (spec is not None and self.in_flight.holds_any)
        held = self.in_flight.held if holds else None
        # With the policy off (a big batch) speculation costs nothing per request: no proposal is even considered.
        proposing = spec if spec is not None and spec.active else None
        # The loop runs once per running request per step: what it calls is looked up once, here.
        running, tokens_to_schedule, take = Status.RUNNING, self._tokens_to_schedule, self._take
        write, scheduled = self.blocks.write, sent.requests
        for i, req in enumerate(order):
            if budget <= 0 or len(scheduled) >= seats:
                break
            if req.status is not running or (held is not None and held(req.handle)):
                continue  # preempted for a request before it in this step, or in a plan in flight
            todo = tokens_to_schedule(req)
            n = todo if todo <= budget else budget
            if n <= 0 or (n > 1 and self.policy.effective_priority(req, now) < floor):
                continue
            first = req.num_computed_tokens
            drafts: list[int] | None = []
            if proposing is not None and todo == 1 and req.spec is not None and self.view.holds(req.handle):
                drafts = proposing.drafts(req, self._draft_room(req, budget))
                if drafts is None:
                    continue  # it speculates: its next plan waits for this one's tokens
                if drafts:
                    written = write(req.req_id, first, first + 1 + len(drafts))
                    if written is not None:  # proposals never preempt anyone: without blocks, a plain decode
                        take(req, 1 + len(drafts), True, plan, sent, written, drafts)
                        budget -= 1 + len(drafts)
                        continue
                    drafts = []
            while (written := write(req.req_id, first, first + n)) is None:
                later = self._same_pool(req, order[i + 1 :])  # the less valued ones that hold blocks it can use
                victim = self._pick_victim([r for r in later if self._schedulable(r, held)], now)
                if victim is None and held is not None and any(self._running_in_flight(r, held) for r in later):
                    # Those it could displace are in plans in flight: it waits for their results instead of
                    # preempting itself (two big requests doing that to each other would take turns forever).
                    break
                victim = victim or req
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                take(req, n, n == todo, plan, sent, written)
                budget -= n
        if not preempted or not self.running:  # a request that preempted itself leaves the cache to the others
            self._admit(budget, seats, floor, plan, sent, now)
        if proposing is not None and proposing.proposer.on_worker:
            plan.propose = proposing.to_draft(sent.requests, sent.samples)
        if sent.requests:
            self.in_flight.record(plan.step_id, sent)
        self.view.finish_plan(plan, self.blocks.take_ops())
        plan.compact_block_base = self.blocks.num_blocks if self.blocks.num_compact_blocks else 0
        if self.tiers is not None:
            plan.tier_moves = self.tiers.take_moves()
        self._hand_off(plan, now)
        return plan

    def _hand_off(self, plan: StepPlan, now: float) -> None:
        """The plan's KV leases and imports (core/kv_handoff.py); leases past their time are released first."""
        leases = self.leases
        if leases.held:
            leases.expire(self.blocks, now)
        plan.kv_revokes, plan.kv_grants, plan.kv_imports = leases.revokes, leases.grants, leases.imports
        leases.revokes, leases.grants, leases.imports = [], [], []

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """From now on every hash that enters or leaves the prefix cache (any tier) is reported to `sink`."""
        self.kv_events = sink
        self._attach_tiers()

    def _attach_tiers(self) -> None:
        """Cached blocks the device pool hands out again go to the offload tiers (when there are any); the prefix
        cache's changes go to the KV event sink (when there is one)."""
        if self.tiers is not None:
            self.blocks.on_evict = self.tiers.offload
            self.tiers.events = self.kv_events
        self.blocks.events = self.kv_events

    def _new_table(self, num_host_blocks: int, num_compact_blocks: int) -> None:
        """An empty block table of the same size (a lost rank, a smaller world): nothing is cached any more."""
        old = self.blocks
        self.blocks = BlockTable(
            old.num_blocks, old.block_size, old.enable_prefix_caching, num_host_blocks, num_compact_blocks
        )
        self.blocks.resize(old.usable_blocks)
        if self.kv_events is not None:
            self.kv_events.cleared(DEVICE)

    def _same_pool(self, req: Request, others: list[Request]) -> list[Request]:
        """Those of `others` whose blocks are of `req`'s format: preempting (or waiting for) one of the other pool
        frees nothing `req` can use, and a request that did so each step would restart them forever."""
        if not self.blocks.num_compact_blocks:
            return others
        fmt = self.blocks.format_of(req.req_id)
        return [r for r in others if self.blocks.format_of(r.req_id) is fmt]

    @staticmethod
    def _running_in_flight(req: Request, held: Callable[[int], bool]) -> bool:
        return req.status is Status.RUNNING and held(req.handle)

    @staticmethod
    def _schedulable(req: Request, held: Callable[[int], bool] | None) -> bool:
        return req.status is Status.RUNNING and not (held is not None and held(req.handle))

    def _pick_victim(self, candidates: list[Request], now: float) -> Request | None:
        """The policy's least valued of these (under a stable order they are in it: the last one)."""
        if self.policy.stable_order:
            return candidates[-1] if candidates else None
        return self.policy.pick_victim(candidates, now)

    def _seats_per_plan(self) -> int:
        """Requests one plan may hold. With disjoint plans, a 1/N share of what can run at once for N plans in
        flight: a plan that took every request would leave the next one empty and the stages in lock-step."""
        if not self.mode.disjoint_plans:
            return self.config.max_num_seqs
        runnable = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-runnable // self.mode.plans_in_flight))

    def _draft_room(self, req: Request, budget: int) -> int:
        """Proposals a decode of `req` may add: within the step's budget, before max_tokens (the step samples one
        more token than it proposes) and max_model_len (each proposal takes a KV slot)."""
        return min(
            budget - 1,
            req.stop.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens,
        )

    @staticmethod
    def _tokens_to_schedule(req: Request) -> int:
        """Tokens to compute: up to the known ones plus the sampled ones still in flight (async
        scheduling), never past max_tokens."""
        num_output = len(req.output_token_ids)
        if num_output + req.num_placeholders >= req.stop.max_tokens:
            return 0
        return len(req.prompt_token_ids) + num_output + req.num_placeholders - req.num_computed_tokens

    def _waiting_head(self, now: float) -> Request | None:
        """The waiting request the policy ranks first, leaving out those held by a plan in flight."""
        candidates = (r for r in self.waiting if not self.in_flight.held(r.handle))
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
                if req.kv_source is not None:  # pulled from another replica instead (core/kv_handoff.py)
                    held = len(req.kv_source.blocks) if fmt is BlockFormat.FULL and bt.enable_prefix_caching else 0
                    loads = max(0, min(held, cacheable) - len(hits))
                hit_tokens = (len(hits) + loads) * bt.block_size
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

    def _admit(self, budget: int, seats: int, floor: float, plan: StepPlan, sent: SentPlan, now: float) -> None:
        """Start waiting requests in policy order while budget, seats and blocks last. Forks (n > 1) that wait
        while holding their parent's prompt blocks go first: left waiting, they would keep those blocks from a
        request that needs the whole cache, which would then preempt itself over and over. When nothing runs and
        none of them can start, they let go one by one until one does (or none holds blocks): a step that starts
        nothing while nothing runs would leave the engine nothing to wait for."""
        while (holders := self._admit_pass(budget, seats, floor, plan, sent, now)) and not self.running:
            self._release_blocks(holders[-1])  # nothing started: the budget and seats are as they were

    def _admit_pass(
        self, budget: int, seats: int, floor: float, plan: StepPlan, sent: SentPlan, now: float
    ) -> list[Request]:
        """One pass over the waiting queue (see `_admit`); returns the waiting requests that hold blocks."""
        if not self._room(budget, seats, sent):
            return []  # nothing can start: the queue is not even looked at (something runs, so no fork must let go)
        ordered = list(self.waiting) if self.policy.stable_order else self.policy.order_waiting(self.waiting, now)
        holders = [r for r in ordered if not r.swapped and self.blocks.blocks_of(r.req_id)]
        holding = set(holders)
        for req in holders + [r for r in ordered if r not in holding]:
            if not self._room(budget, seats, sent):
                break
            holds_blocks = req in holding
            if self.policy.effective_priority(req, now) < floor and not holds_blocks:
                break  # waiting is in policy order: the rest rank lower still
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
            hit_tokens = (len(hits) + loads) * bt.block_size
            if req.num_preemptions == 0 and not req.output_token_ids:  # new prompts only: resumptions inflate it
                self.counters.prefix_cache_queries += req.num_tokens
                self.counters.prefix_cache_hits += hit_tokens
                req.num_cached_tokens = hit_tokens
            bt.acquire(req.req_id, hits, fmt)
            if loads:
                hashes = req.update_block_hashes(bt.block_size)
                if req.kv_source is not None:
                    self._load_from_remote(req, len(hits), hashes[len(hits) : len(hits) + loads])
                else:
                    self._load_from_tiers(req, hashes[len(hits) : len(hits) + loads])
                bt.register(req.req_id, hashes[: len(hits) + loads])
            req.num_computed_tokens = hit_tokens
        req.kv_source = None  # used once: a request that recomputes later computes its prompt here
        return True

    def _load_from_remote(self, req: Request, first: int, keys: list[BlockHash]) -> None:
        """New blocks after the request's cached prefix, filled by the plan's KV import from the producer replica
        (core/kv_handoff.py) instead of being computed."""
        assert req.kv_source is not None
        bt = self.blocks
        start = len(bt.blocks_of(req.req_id)) * bt.block_size
        written = bt.write(req.req_id, start, start + len(keys) * bt.block_size)
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

    def _take(
        self,
        req: Request,
        n: int,
        samples: bool,
        plan: StepPlan,
        sent: SentPlan,
        written: Written,
        drafts: list[int] | None = None,
    ) -> None:
        """`req` computes `n` tokens in this plan, its last ones if `samples` (the step then samples its next
        token); its blocks are `written` already. With `drafts`, its last n - 1 tokens are these proposals, which
        the result accepts or not (`update` rolls the rejected ones back)."""
        first = req.num_computed_tokens
        self.view.add_to_plan(req, plan, first, n, self.blocks, written, drafts)
        req.num_computed_tokens = first + n
        if req.kv_lease and samples and not req.output_token_ids:  # a producer's prompt is computed by this plan
            blocks = self.blocks.blocks_of(req.req_id)[: self._prompt_blocks(req)]
            self.leases.grants.append(KVGrant(req.kv_lease, blocks))
        if samples:
            req.num_placeholders += 1  # this step samples a token the scheduler learns of later
        sent.add(req, n, samples, len(drafts) if drafts else 0)

    def _preempt(self, req: Request, mode: PreemptionMode | None = None) -> None:
        mode = mode or self._preemption_mode(req)
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
        self.view.forget(req, preempted=True)
        logger.info("preempted %s by %s: %d tokens, %d blocks", req.req_id, mode.value, tokens, blocks)
        self.running.remove(req)
        self._catching_up.discard(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self._enqueue(req)

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
        moved = self.view.replace_blocks(self._by_handles(self.blocks.compact(self.config.compaction_max_moves)))
        self.counters.compaction_moves += moved
        self.counters.compaction_seconds += time.perf_counter() - start

    # ---- results

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Register the blocks the step filled for prefix caching, append sampled tokens, apply stop conditions."""
        sent = self.in_flight.settle(plan.step_id)
        if result.failed_loads:
            self._recompute_failed_loads(result)
        if result.failed_stores and self.tiers is not None:
            self.tiers.drop_failed_stores(result.failed_stores)
        if result.interrupted:
            self._undo(sent)
            return []
        tokens = sent.total_tokens
        self.costs.observe(result.execute_ms, tokens)
        if self.tiers is not None:
            self.tiers.observe(result)
        if sent.requests:
            self.counters.steps += 1
            self.counters.worker_idle_ms += result.idle_ms
            self.counters.scheduled_tokens += tokens
        if sent.num_drafted:
            self._settle_drafts(sent, result)
        self._register_filled_blocks(sent)
        for handle, (first, logprobs) in result.prompt_logprobs.items():
            if (req := self._by_handle.get(handle)) is not None:  # kept even if preempted since: positions checked
                req.add_prompt_logprobs(first, logprobs)
        for handle, (first, count, data) in result.pooled.items():
            if (req := self._by_handle.get(handle)) is not None:
                req.add_pooled(first, count, data)
        outputs = []
        # Once per sampling request per step: what the loop calls is looked up once, here.
        all_logprobs, max_len, running = result.logprobs, self.max_model_len, Status.RUNNING
        live = self._by_handle
        for handle, token_ids in result.sampled.items():
            req = live.get(handle)
            if req is None or req.status is not running:
                continue  # aborted or preempted while the step ran
            req.num_placeholders -= 1  # one sampling step: one token, or with proposals the accepted ones and one
            kept = req.append_tokens(token_ids, max_len)
            if req.forks:
                self._start_forks(req)
            logprobs = all_logprobs[handle][: len(kept)] if all_logprobs and handle in all_logprobs else []
            if req.status is running:
                outputs.append(RequestOutput(req, kept, logprobs))
                continue
            end = req.status  # it finished
            outputs.append(RequestOutput(req, kept, logprobs, *_ending(req)))
            self.finish(req.req_id, end)
        if self.speculator is not None:
            if sent.num_drafted:
                self._register_filled_blocks(sent)  # the blocks filled by accepted proposals: hashable only now
            for handle, drafted in result.drafts.items():  # a draft model's proposals for the next step
                if (req := live.get(handle)) is not None and req.status is running:
                    self.speculator.drafted(req, drafted)
        return outputs

    def _settle_drafts(self, sent: SentPlan, result: StepResult) -> None:
        """Each speculated request's proposals: the result's tokens are the accepted ones and one more; the
        rejected ones' KV slots are not computed after all (both sides roll back: the worker as it verified).
        Their blocks stay the request's, to be written by its next steps (as vLLM's do)."""
        assert self.speculator is not None
        for i, (req, proposed) in enumerate(zip(sent.requests, sent.drafts)):
            if not proposed:
                continue
            tokens = result.sampled.get(req.handle)
            accepted = len(tokens) - 1 if tokens else 0
            rejected = proposed - accepted
            sent.ends[i] -= rejected
            sent.tokens[i] -= rejected
            if req.status is Status.RUNNING and req.num_preemptions == sent.runs[i]:
                req.num_computed_tokens -= rejected
                self.speculator.observe(req, proposed, accepted)

    def _recompute_failed_loads(self, result: StepResult) -> None:
        """Tier blocks the workers could not load (a disk copy corrupted since start): no tier or prefix match
        offers them again, and every request that reads them (those the workers left out of the step, and any
        later one that found them in the device cache) computes them instead: preempted by recompute, it comes
        back with its cached prefix and recomputes from the first failed block on."""
        logger.warning("%d KV block(s) failed to load or import: recomputing them", len(result.failed_loads))
        if self.tiers is not None:
            self.tiers.forget_failed(result.failed_loads)
        bad = {b for h in result.failed_loads if (b := self.blocks.uncache(h)) is not None}
        readers = [r for h in result.load_skipped if (r := self._by_handle.get(h)) is not None]
        readers += [r for r in self.running if not bad.isdisjoint(self.blocks.blocks_of(r.req_id))]
        for req in dict.fromkeys(readers):
            if req.status is Status.RUNNING:
                self._preempt(req, PreemptionMode.RECOMPUTE)
            elif req.swapped:  # swapped out since, with the bad block: its copy is dropped too
                self.blocks.free(req.req_id)
                req.swapped = False
                req.num_computed_tokens = 0

    def _register_filled_blocks(self, sent: SentPlan) -> None:
        """The blocks each request's step filled (one in block_size decode steps) get their hashes. This step's
        own end counts, not num_computed_tokens: that counts plans still in flight, whose blocks are not written
        yet (and are never written if those plans are interrupted)."""
        bt = self.blocks
        if not bt.enable_prefix_caching:
            return
        bs = bt.block_size
        for req, n, end, run in zip(sent.requests, sent.tokens, sent.ends, sent.runs):
            first_block, full = (end - n) // bs, end // bs
            if full > first_block and req.status is Status.RUNNING and req.num_preemptions == run:
                hashes = req.update_block_hashes(bs)  # accepted proposals are hashable once they are tokens
                bt.register(req.req_id, hashes, first_block, min(full, len(hashes)))

    def _undo(self, sent: SentPlan) -> None:
        """The workers skipped this plan's compute: its requests are back where they were before it (the
        blocks it allocated stay theirs; its diffs and block operations did run)."""
        self.counters.interrupted_steps += 1
        for req, n, samples, run in zip(sent.requests, sent.tokens, sent.samples, sent.runs):
            if req.status is not Status.RUNNING or req.num_preemptions != run:
                continue  # finished or preempted since: nothing of this step is kept for it
            req.num_computed_tokens -= n
            if samples:
                req.num_placeholders -= 1
            self._catching_up.add(req)

    def interruptible(self, plans: list[StepPlan]) -> bool:
        """May these plans in flight be interrupted at all? The one answer: in a world that can stop mid-step (a
        lone worker: `ExecutionMode.interruptible`), plans whose compute can be skipped (`can_undo`)."""
        return bool(plans) and self.mode.interruptible and self.can_undo(plans)

    def may_interrupt(self, req: Request, plans: list[StepPlan]) -> bool:
        """May `req` have the workers skip these plans in flight? When they are `interruptible` and it outranks
        every request in them by the policy's margin (never under fcfs)."""
        if not self.interruptible(plans):
            return False
        now = self.clock()
        outranks_some = False
        for plan in plans:
            for other in self.in_flight.requests_of(plan.step_id):
                if self._by_handle.get(other.handle) is other:  # still live
                    if not self.policy.displaces(req, other, now):
                        return False
                    outranks_some = True
        return outranks_some

    @staticmethod
    def can_undo(plans: list[StepPlan]) -> bool:
        """Plans whose compute can be skipped: none swaps out (a swapped-out request keeps its computed tokens,
        which a skipped step before it would not have written). A skipped plan still swaps in (its block work
        runs), and a request it preempted recomputes from scratch, so plans that resume a displaced request stay
        interruptible: a realtime request arriving as one resumes does not wait for it."""
        return not any(p.swap_out for p in plans)

    def requests_in(self, plan: StepPlan) -> list[Request]:
        """The live requests a plan computes."""
        return [r for h in plan.num_scheduled_tokens if (r := self._by_handle.get(h)) is not None]

    def _start_forks(self, parent: Request) -> None:
        """The prompt is computed: each sibling shares its blocks and recomputes only the last prompt token,
        so it samples its own first token; the shared last block is copied when first written."""
        prompt_len = len(parent.prompt_token_ids)
        for child in parent.forks:
            self.blocks.fork(parent.req_id, child.req_id, prompt_len)
            child.num_computed_tokens = prompt_len - 1
            child.num_cached_tokens = parent.num_cached_tokens  # the prompt they share
            self._enqueue(child)
        parent.forks = ()

    # ---- worker failure

    def requeue_all(self, workers_lost: bool = True) -> int:
        """The workers' KV is gone (a rank was lost) or not to be trusted (a step failed): every running request
        goes back to waiting, to be recomputed, swapped and forked ones drop their blocks too, and the prefix cache
        starts empty (the replacement worker's cache holds nothing). Workers that were not lost still hold their
        requests: the next plan tells them to forget every one (and the finished ones already noted). Returns how
        many requests were running."""
        running, self.running = self.running, []
        self._catching_up.clear()
        for req in running:
            req.status = Status.PREEMPTED
            req.num_preemptions += 1
            self.counters.preemptions_recompute += 1
            self._enqueue(req)
        for req in self.requests.values():
            req.num_computed_tokens = 0
            req.num_placeholders = 0
            req.swapped = False
        if workers_lost:
            self.view.forget_all()
        else:
            self.view.preempt_all()
        self._new_table(self.blocks.num_host_blocks, self.blocks.num_compact_blocks)
        self.leases.clear()
        if self.tiers is not None:
            self.tiers.clear()  # until the world is back: then its disk blocks are adopted again (engine core)
        self._attach_tiers()
        self.in_flight.clear()  # the engine dropped every plan in flight
        return len(running)

    def fit_capacity(self, num_blocks: int, num_host_blocks: int, num_compact_blocks: int | None = None) -> None:
        """The world came back holding fewer blocks than before (a replacement could not allocate the world's
        size): only that many are handed out from now on. Called on an empty table, right after `requeue_all`."""
        self.blocks.resize(min(num_blocks, self.blocks.usable_blocks))
        compact = self.blocks.num_compact_blocks if num_compact_blocks is None else num_compact_blocks
        if num_host_blocks < self.blocks.num_host_blocks or compact < self.blocks.num_compact_blocks:
            bt = self.blocks
            self._new_table(min(num_host_blocks, bt.num_host_blocks), min(compact, bt.num_compact_blocks))
            self._attach_tiers()


def _ending(req: Request) -> tuple[FinishReason, bool, int, int, list[float] | None]:
    """What a RequestOutput copies of a request its tokens ended (the output side reads it on another thread)."""
    embedding = req.embedding() if req.sampling.pooling else None
    return req.status.finish_reason, req.stopped_by_token, len(req.output_token_ids), req.num_cached_tokens, embedding
