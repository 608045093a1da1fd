"""How the engine loop lives through failures: a lost rank (requeue, wait for a replacement, resume by recompute
or give up), a world that came back smaller, a request that could never start, a step a worker could not run, the
requests whose own computation failed, a request's deadline. The engine core (engine/core.py) owns it and calls it
from its loop; the intake arms deadlines through it."""

from __future__ import annotations

import asyncio
import logging
import time

from proto.transport import StepFailed, WorkerTransport
from proto.wire import StepPlan, StepResult
from scheduler_node.core.request import Request, Status
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.handoffs import Handoffs
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.options import EngineOptions
from scheduler_node.engine.output_side import OutputSide
from scheduler_node.engine.outputs import EngineError, ErrorStatus
from scheduler_node.engine.serving_state import ServingState

logger = logging.getLogger(__name__)


class Failures:
    def __init__(
        self,
        scheduler: Scheduler,
        workers: WorkerTransport,
        options: EngineOptions,
        metrics: Metrics,
        outputs: OutputSide,
        handoffs: Handoffs,  # sequences leaving with their KV go out without it when their requests end
        state: ServingState,  # gave_up is this object's to set
        wake: asyncio.Event,  # the engine core's: the workers must be told to forget what ended
    ) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.options = options
        self.metrics = metrics
        self.outputs = outputs
        self.handoffs = handoffs
        self.state = state
        self._wake = wake

    def end_all(self, reason: str, status: ErrorStatus) -> None:
        """End every live request with an error and free its blocks (those migrating leave with their states)."""
        self.handoffs.migrate_without_kv()
        for req_id in list(self.outputs.request_of):
            req = self.scheduler.finish(req_id, Status.FINISHED_ERROR)
            if req is not None:
                self.outputs.end(req, EngineError(status, reason))
        self._wake.set()

    async def recover(self) -> None:
        """A rank is lost with its KV: requeue everything, wait for a replacement, resume by recompute.

        If none joins within the rejoin timeout, every live request ends with UNAVAILABLE and new ones are
        refused until the ranks are complete again."""
        reason = self.workers.lost_reason or "a rank is not ready"
        self.metrics.worker_losses.inc()
        running = self.scheduler.requeue_all()
        timeout = self.options.rejoin_timeout
        if self.state.draining:
            self.end_all(f"{reason} while draining", ErrorStatus.UNAVAILABLE)
        else:
            logger.warning(
                "%s: %d running request(s) back to waiting; waiting up to %g s for a replacement worker",
                reason,
                running,
                timeout,
            )
            if await self.workers.wait_ready(timeout):
                self._world_back()
                logger.info("every rank is ready; resuming %d request(s) by recompute", self.scheduler.num_unfinished)
                return
        self.state.gave_up = f"{reason}, and no worker rejoined within {timeout:g} s"
        logger.error("%s: failing %d live request(s)", self.state.gave_up, self.outputs.num_live)
        self.end_all(self.state.gave_up, ErrorStatus.UNAVAILABLE)
        await self.workers.wait_ready(None)
        self.scheduler.requeue_all()  # start from a clean slate: no notices for the old workers
        self._world_back()
        self.state.gave_up = ""
        self.workers.changed.set()  # health: SERVING again
        logger.info("every rank is ready again; serving")

    def _world_back(self) -> None:
        """Every rank is ready again: the scheduler fits the world's capacity, and its disk tier index takes
        back the blocks every restarted rank found intact in its file (the RAM tier died with the workers). A
        block whose copy changed since is caught by its check when loaded, and recomputed."""
        self._fit_capacity()
        if self.scheduler.tiers is not None:
            self.scheduler.tiers.adopt_disk(self.workers.capacity.disk_tier_entries)

    def _fit_capacity(self) -> None:
        """A replacement that could not hold the world's KV size shrank the world: the scheduler follows (and
        max_model_len with it), and requests that could no longer finish end (they would wait forever)."""
        capacity = self.workers.capacity
        blocks = self.scheduler.blocks
        compact = capacity.num_compact_blocks
        if (
            capacity.num_kv_blocks >= blocks.usable_blocks
            and capacity.num_swap_blocks >= blocks.num_host_blocks
            and compact >= blocks.num_compact_blocks
        ):
            return
        self.scheduler.fit_capacity(capacity.num_kv_blocks, capacity.num_swap_blocks, compact)
        limit = self.scheduler.max_model_len
        for req in self.scheduler.stranded(self.scheduler.blocks.usable_blocks):
            message = (
                f"the KV cache shrank to {limit} tokens (a replacement worker holds fewer blocks); this request "
                f"needs up to {req.num_tokens_at_most} (prompt + max_tokens)"
            )
            self.scheduler.finish(req.req_id, Status.FINISHED_ERROR)
            self.outputs.end(req, EngineError(ErrorStatus.UNAVAILABLE, message))

    def end_unstartable(self) -> None:
        """Nothing runs or is in flight, yet the scheduler started no waiting request: the first of them could
        never start. It ends with an error instead of stopping the engine (every later request would fail)."""
        head = self.scheduler.policy.order_waiting(self.scheduler.waiting, time.monotonic())[0]
        free = self.scheduler.blocks.num_free
        message = f"the scheduler could not start this request ({head.num_tokens} tokens, {free} free KV blocks)"
        logger.error("%s: %s", head.req_id, message)
        for req in [head, *head.forks]:
            self.scheduler.finish(req.req_id, Status.FINISHED_ERROR)
            self.outputs.end(req, EngineError(ErrorStatus.INTERNAL, message))

    def fail_step(self, plan: StepPlan, exc: StepFailed) -> None:
        """A worker could not run the plan. The requests it blamed (StepError.handles) fail alone; with nobody
        blamed, a request that ran alone fails, and the requests of a larger step become suspects that run alone
        until each has sampled (core/quarantine.py): one request's problem never fails another. Everything else is
        recomputed (worker state is suspect): the workers are alive and keep what they hold, so they are told to
        forget all of it."""
        requests = self.scheduler.requests_in(plan)
        for adapter in exc.adapters:  # refused from now on, at the door: it would fail a step each time
            self.state.unusable_loras[adapter] = str(exc)
        if exc.handles:
            blamed = set(exc.handles)
            culprits = [r for r in requests if r.handle in blamed]
            status = ErrorStatus.FAILED_PRECONDITION
        elif len(requests) == 1:
            culprits, status = requests, ErrorStatus.INTERNAL
        else:
            culprits, status = [], ErrorStatus.INTERNAL
            self.scheduler.quarantine.add(r.req_id for r in requests)
            logger.error("%s; its %d request(s) will run alone until each has sampled", exc, len(requests))
        if culprits:
            logger.error("%s; failing %s", exc, ", ".join(r.req_id for r in culprits))
        for req in culprits:
            self._fail_request(req, EngineError(status, str(exc)))
        self.scheduler.requeue_all(workers_lost=False)

    def fail_faulted(self, faulted: dict[int, str]) -> None:
        """The requests whose own computation failed in a step that otherwise went through (their logits were not
        finite): they fail alone, before the step's result is applied, so nothing of theirs is kept."""
        for handle, reason in faulted.items():
            req = self.scheduler.request_of(handle)
            if req is not None:
                adapter = f" (adapter {req.lora.name!r})" if req.lora is not None else ""
                logger.error("%s: %s%s", req.req_id, reason, adapter)
                self._fail_request(req, EngineError(ErrorStatus.FAILED_PRECONDITION, reason + adapter))

    def _fail_request(self, req: Request, error: EngineError) -> None:
        """End one sequence with an error, and its siblings (n > 1) still waiting for its prompt: nothing would
        ever start them."""
        for r in [req, *req.forks]:
            if self.scheduler.finish(r.req_id, Status.FINISHED_ERROR) is not None:
                self.outputs.end(r, EngineError(error.status, error.message))

    def clear_suspects(self, plan: StepPlan, result: StepResult) -> None:
        """Suspects run alone: one that sampled in this step, which went through, is innocent."""
        quarantine = self.scheduler.quarantine
        for req in self.scheduler.requests_in(plan):
            if req.req_id in quarantine and result.tokens_of(req.handle):
                quarantine.release(req.req_id)

    def arm_deadline(self, request_id: str, deadline_s: float) -> None:
        """The request ends with DEADLINE_EXCEEDED `deadline_s` seconds from now unless it ended before (the output
        side cancels the timer when its last sequence ends)."""
        expire = asyncio.get_running_loop().call_later(deadline_s, self._expire, request_id, deadline_s)
        self.outputs.deadlines[request_id] = expire

    def _expire(self, request_id: str, deadline_s: float) -> None:
        self.outputs.deadlines.pop(request_id, None)
        for req_id in list(self.outputs.requests.get(request_id, [])):
            req = self.scheduler.finish(req_id, Status.FINISHED_ERROR)
            if req is not None:
                error = f"deadline_s: {deadline_s:g} s passed before the request finished"
                self.outputs.end(req, EngineError(ErrorStatus.DEADLINE_EXCEEDED, error))
        self._wake.set()  # tell the workers to forget them
