"""Admission: which waiting requests start in a step (policy order, budget, seats, LoRA slots, blocks: the blocks
their start takes are `BlockClaims`'), the prefill floor that keeps low-priority prefill out of a high-priority
request's way, displacement of running requests by a waiting one that outranks them, and migrated sequences that
claim their blocks on arrival."""

from __future__ import annotations

import logging

from proto.multimodal import MAX_PLAN_IMAGE_BYTES
from scheduler_node.core.block_claims import BlockClaims
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.in_flight import InFlightLedger
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.migrations_in import MigrationsIn
from scheduler_node.core.policy import Policy
from scheduler_node.core.preemption import Preemption
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request
from scheduler_node.core.step import PlanWriter, Step
from scheduler_node.core.worker_view import WorkerView

logger = logging.getLogger(__name__)


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        queues: RequestQueues,
        policy: Policy,
        claims: BlockClaims,
        preemption: Preemption,
        writer: PlanWriter,
        blocks: BlockTable,
        in_flight: InFlightLedger,
        view: WorkerView,
        migrations: MigrationsIn,
    ) -> None:
        self.config = config
        self.queues = queues
        self.policy = policy
        self.claims = claims
        self.preemption = preemption
        self.writer = writer
        self.blocks = blocks
        self.in_flight = in_flight
        self.view = view
        self.migrations = migrations

    def _waiting_head(self, now: float) -> Request | None:
        """The waiting request the policy ranks first, leaving out those held by a plan in flight."""
        candidates = (r for r in self.queues.waiting if not self.in_flight.held(r.handle) and not r.pulling)
        if self.policy.stable_order:
            return next(candidates, None)  # waiting is in the policy's order
        return min(candidates, key=lambda r: self.policy.sort_key(r, now), default=None)

    def displace_for_priority(self, now: float, budget: int) -> None:
        """Before the step: while the best waiting request finds no seat or no blocks, it displaces the
        least valued running request if it beats it by the policy's margin."""
        head = self._waiting_head(now)
        while head is not None and not self._fits(head, budget):
            victim = self.preemption.pick_victim(self.queues.running, now)
            if victim is None or not self.policy.displaces(head, victim, now):
                return
            logger.info("%s displaces %s by priority", head.req_id, victim.req_id)
            self.preemption.preempt(victim)

    def _fits(self, req: Request, budget: int) -> bool:
        """Would a waiting request get a seat and its blocks now (prefix-cache hits counted)?"""
        return len(self.queues.running) < self.config.max_num_seqs and self.claims.fits(req, budget)

    def prefill_floor(self, now: float) -> float:
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
            pending = [r for r in self.queues.waiting if not held(r.handle)]
        pending += self.queues.catching_up_pending(held)
        if not pending:
            return float("-inf")
        return max(self.policy.effective_priority(r, now) for r in pending) - self.policy.preemption_margin

    def admit(self, step: Step) -> None:
        """Start waiting requests in policy order while budget, seats and blocks last. Forks (n > 1) that wait
        while holding their parent's prompt blocks go first: left waiting, they would keep those blocks from a
        request that needs the whole cache, which would then preempt itself over and over. When nothing runs and
        none of them can start, they let go one by one until one does (or none holds blocks): a step that starts
        nothing while nothing runs would leave the engine nothing to wait for."""
        while (holders := self._admit_pass(step)) and not self.queues.running:
            self.preemption.release_blocks(holders[-1])  # nothing started: the budget and seats are as they were

    def _admit_pass(self, step: Step) -> list[Request]:
        """One pass over the waiting queue (see `admit`); returns the waiting requests that hold blocks."""
        budget, sent, excluded = step.budget, step.sent, step.excluded
        if not self._room(budget, step.seats, len(sent.requests)):
            return []  # nothing can start: the queue is not even looked at (something runs, so no fork must let go)
        waiting, now = self.queues.waiting, step.now
        ordered = list(waiting) if self.policy.stable_order else self.policy.order_waiting(waiting, now)
        # A migrated sequence pulling its KV holds blocks too, but starts only once its pull is done (`pulling`).
        holders = [r for r in ordered if not r.swapped and not r.pulling and self.blocks.blocks_of(r.req_id)]
        holding = set(holders)
        image_bytes = 0  # the started requests' pixel values in this plan (bounded: MAX_PLAN_IMAGE_BYTES)
        for req in holders + [r for r in ordered if r not in holding]:
            if not self._room(budget, step.seats, len(sent.requests)):
                break
            if req.pulling or (excluded is not None and excluded(req)):
                continue  # (a suspect outside its own step, or another request in a suspect's step: quarantine.py)
            holds_blocks = req in holding
            if self.policy.effective_priority(req, now) < step.floor:
                if not holds_blocks:
                    break  # waiting is in policy order: the rest rank lower still
                if req.output_token_ids:
                    continue  # a migrated sequence holding its KV (no fork has outputs): it yields to a class above
            if self.in_flight.held(req.handle):
                continue  # preempted while its plan runs: it comes back once that result is applied
            if req.lora is not None and not self.view.lora_slots.fits(req.lora):
                continue  # every LoRA slot is pinned by running requests: it waits, the others pass
            if req.images and image_bytes and image_bytes + req.image_bytes > MAX_PLAN_IMAGE_BYTES:
                continue  # the plan carries enough pixels: it starts in the next one, first in line as now
            if not self.claims.claim(req, budget):
                if holds_blocks:
                    continue
                break  # strict order: a big request at the head is not overtaken forever
            budget -= self._start(req, budget, step)
            image_bytes += req.image_bytes
        return holders

    def _start(self, req: Request, budget: int, step: Step) -> int:
        """A request that claimed its blocks runs, its first chunk in this plan; returns the chunk's tokens."""
        self.queues.start_running(req)
        todo = req.tokens_to_schedule()
        n = min(todo, budget)
        written = self.blocks.write(req.req_id, req.num_computed_tokens, req.num_computed_tokens + n)
        if written is None:
            raise RuntimeError(f"{req.req_id}: its blocks were claimed, yet they do not fit")
        self.writer.take(req, n, n == todo, step.plan, step.sent, written)
        return n

    def _room(self, budget: int, seats: int, taken: int) -> bool:
        """Can one more request start in this plan?"""
        return budget > 0 and len(self.queues.running) < self.config.max_num_seqs and taken < seats

    def pin_arrivals(self) -> None:
        """Migrated sequences that arrived with their KV leased on the source and did not start in this plan claim
        their blocks now and pull their KV with this plan, seat or no seat: the source's lease lasts seconds and a
        seat here may take longer (every seat held by long runs), and an Abort from the router, once a sibling
        (n > 1) answered, releases it too. Holding its blocks, a sequence starts before waiting requests that hold
        none (`_admit_pass`), as a preempted one resumes before new ones. Without blocks now (admission's fit
        rule, the watermark kept), it tries again each step; its lease may run out meanwhile: it then recomputes."""
        migrations = self.migrations
        for req, told in migrations.arrivals():
            if not self.queues.is_live(req) or req.kv_source is None:
                migrations.claimed(req)  # ended, or started (admission pulled its KV in that plan)
            elif self.claims.claim(req, self.config.max_num_batched_tokens):
                migrations.claimed(req)
                req.pulling = migrations.pulls_last(req)
            elif not told:
                migrations.told(req)
                logger.info("%s: migrated in, no free blocks to pull its KV into yet: it tries each step", req.req_id)
