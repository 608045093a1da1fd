"""The scheduler: one rule for prefill, chunked prefill, resumption and decode.

Each request has `num_computed_tokens` and `num_tokens`; every step hands out tokens from a budget
(`max_num_batched_tokens`, `max_num_seqs`) so that the first catches up with the second. When blocks run out,
the policy's least valued running request is preempted by recompute and goes back to waiting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from proto.wire import CachedRequest, StepPlan, StepResult, TokenLogprobs
from scheduler_node.block_table import BlockTable
from scheduler_node.config import SchedulerConfig
from scheduler_node.policy import Policy
from scheduler_node.request import Request, Status

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, policy: Policy | None = None) -> None:
        self.config = config
        self.policy = policy or Policy()
        self.blocks = BlockTable(num_blocks, config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._on_worker: set[str] = set()  # requests whose state the workers hold
        self._pending_new_blocks: dict[str, list[int]] = {}
        self._finished_ids: list[str] = []  # to tell the workers in the next plan
        self._preempted_ids: list[str] = []
        self._step_id = 0
        self.num_preemptions = 0

    # ---- queue management

    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise KeyError(f"request {req.req_id!r} is already live")
        self.requests[req.req_id] = req
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
        self._release(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids or self._preempted_ids)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step

    def schedule(self) -> StepPlan:
        self._step_id += 1
        plan = StepPlan(self._step_id)
        budget = self.config.max_num_batched_tokens
        preempted = False
        to_schedule = self.policy.order_running(self.running)
        while to_schedule and budget > 0:
            req = to_schedule.pop(0)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self.blocks.can_grow(req.req_id, req.num_computed_tokens + n):
                victim = self.policy.pick_victim(to_schedule) or req
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                to_schedule.remove(victim)
            else:
                self._take(req, n, plan)
                budget -= n
        if not preempted:
            budget = self._admit(budget, plan)
        self._attach_diffs(plan)
        return plan

    def _admit(self, budget: int, plan: StepPlan) -> int:
        for req in self.policy.order_waiting(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.blocks.can_grow(req.req_id, req.num_computed_tokens + n):
                break  # strict order: a big request at the head is not overtaken forever
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            self._take(req, n, plan)
            budget -= n
        return budget

    def _take(self, req: Request, n: int, plan: StepPlan) -> None:
        added = self.blocks.grow(req.req_id, req.num_computed_tokens + n)
        if req.req_id in self._on_worker:
            self._pending_new_blocks.setdefault(req.req_id, []).extend(added)
            plan.cached_requests.append(CachedRequest(req.req_id, [], req.num_computed_tokens))
        else:
            plan.new_requests.append(req.to_new_request(self.blocks.blocks_of(req.req_id)))
            self._on_worker.add(req.req_id)
        plan.num_scheduled_tokens[req.req_id] = n
        req.num_computed_tokens += n

    def _attach_diffs(self, plan: StepPlan) -> None:
        for cached in plan.cached_requests:
            cached.new_block_ids = self._pending_new_blocks.pop(cached.req_id, [])
        plan.finished_req_ids, self._finished_ids = self._finished_ids, []
        plan.preempted_req_ids, self._preempted_ids = self._preempted_ids, []

    def _preempt(self, req: Request) -> None:
        blocks = self.blocks.free(req.req_id)
        self._forget_on_worker(req, self._preempted_ids)
        logger.info("preempted %s by recompute: %d tokens, %d blocks", req.req_id, req.num_computed_tokens, blocks)
        self.running.remove(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.req_id)
        self._forget_on_worker(req, self._finished_ids)

    def _forget_on_worker(self, req: Request, notice: list[str]) -> None:
        self._pending_new_blocks.pop(req.req_id, None)
        if req.req_id in self._on_worker:
            self._on_worker.discard(req.req_id)
            notice.append(req.req_id)

    # ---- results

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Append the sampled tokens, apply stop conditions, free what finished."""
        outputs = []
        for req_id, token_ids in result.sampled.items():
            req = self.requests.get(req_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted or preempted while the step ran
            kept = req.append_tokens(token_ids)
            logprobs = result.logprobs.get(req_id, [])[: len(kept)]
            outputs.append(RequestOutput(req, kept, logprobs))
            if req.num_tokens >= self.config.max_model_len and not req.finished:
                req.status = Status.FINISHED_LENGTH
            if req.finished:
                self.finish(req_id, req.status)
        return outputs
