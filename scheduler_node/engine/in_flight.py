"""The plans on the workers, oldest first: built and sent while there is room (the execution mode's plans in
flight), awaited in order under a step deadline, dropped when a rank is lost or a step fails, and interrupted for a
request that outranks them (their requests are rolled back when the interrupted results arrive). Owned by the engine
core (engine/core.py), whose loop consumes the results; the only place plans are kept in flight."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from proto.transport import WorkerLost, WorkerTransport
from proto.wire import StepPlan, StepResult
from scheduler_node.core.request import Request
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.collector import CollectorSchedule
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.options import STEP_SECONDS_PER_TOKEN
from scheduler_node.engine.output_side import OutputSide

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    plan: StepPlan
    future: asyncio.Future[StepResult]
    sent: float  # perf_counter when built
    tokens: int  # the plan's scheduled tokens


class PlansInFlight:
    def __init__(
        self,
        scheduler: Scheduler,
        workers: WorkerTransport,
        metrics: Metrics,
        outputs: OutputSide,
        collector: CollectorSchedule | None,
        wake: asyncio.Event,  # the engine core's: set by a submit, an abort, a finished sequence
    ) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.metrics = metrics
        self.outputs = outputs
        self.collector = collector
        self.mode = scheduler.mode
        self._wake = wake
        self._plans: collections.deque[InFlight] = collections.deque()
        self._interrupting: set[int] = set()  # steps interrupted and not answered yet: no plan is built meanwhile

    def __len__(self) -> int:
        return len(self._plans)

    @property
    def head(self) -> InFlight:
        """The oldest plan: the one the workers run now."""
        return self._plans[0]

    def fill(self) -> None:
        """Build and send plans while there is room, work, and no interrupt pending."""
        while len(self._plans) < self.mode.plans_in_flight and self.scheduler.has_work and not self._interrupting:
            start = time.perf_counter()
            plan = self.scheduler.schedule()
            if self.scheduler.quarantine.planned(plan.has_work):
                continue  # a suspect's turn (or the others') with nothing to run: the next turn at once
            if not plan.has_work:
                break  # every running request waits for an in-flight result
            self.metrics.schedule_time.observe(time.perf_counter() - start)
            self._note_scheduled(plan)
            try:
                future = self.workers.submit(plan)
            except WorkerLost as exc:
                logger.error("step %d could not be sent: %s", plan.step_id, exc)
                return  # the loop sees the lost rank and recovers
            self._plans.append(InFlight(plan, future, start, self.scheduler.scheduled_tokens(plan)))
            if plan.new_requests and self.collector is not None:
                self.collector.admitted()  # once the plan is on its way

    def _note_scheduled(self, plan: StepPlan) -> None:
        for new in plan.new_requests:  # a request is scheduled for the first time as a new one
            req = self.scheduler.request_of(new.handle)
            if req is not None:
                self.outputs.scheduled(req.req_id)

    async def await_head(self, step_timeout: float) -> StepResult:
        """The oldest plan's result. While it runs and there is room for another plan, requests that arrive are
        scheduled at once (they do not wait for this step to end). Its deadline (`step_timeout` plus
        STEP_SECONDS_PER_TOKEN a token) runs from now: the workers run plans in order, so it is the one they work
        on. Past it, the ranks that owe an answer are lost (a hung step, not a slow one)."""
        head = self._plans[0]
        timeout = step_timeout + STEP_SECONDS_PER_TOKEN * head.tokens
        deadline = time.monotonic() + timeout
        reason = f"step {head.plan.step_id} ran past its {timeout:.0f} s deadline"
        while len(self._plans) < self.mode.plans_in_flight and not self._interrupting and not head.future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                self._past_deadline(head, reason)
                break
            self._wake.clear()
            wake: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait((head.future, wake), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
            if not head.future.done() and self._wake.is_set():
                self.fill()
        if not head.future.done():
            # No room (the common case: the pipeline is full): the result's future wakes this task itself (no
            # asyncio.wait in between: one hop of the loop less per step), and a timer fails it at the deadline.
            left = max(0.0, deadline - time.monotonic())
            expire = asyncio.get_running_loop().call_later(left, self._past_deadline, head, reason)
            try:
                await head.future
            finally:
                expire.cancel()
        return head.future.result()

    def _past_deadline(self, head: InFlight, reason: str) -> None:
        """The head's step hung: the ranks that owe it an answer are lost, and it fails with WorkerLost."""
        if head.future.done():
            return
        self.workers.declare_lost(reason)
        if not head.future.done():
            head.future.set_exception(WorkerLost(reason))

    def pop(self) -> InFlight:
        """The oldest plan, answered: off the workers."""
        head = self._plans.popleft()
        self._interrupting.discard(head.plan.step_id)
        return head

    def drop(self) -> None:
        """Forget every plan in flight (a lost rank, a failed step): nobody waits for their results."""
        for entry in self._plans:
            entry.future.cancel()
        self._plans.clear()
        self._interrupting.clear()

    def interrupt(self, req: Request | None = None) -> bool:
        """Have the workers skip the compute of every plan in flight (the running step stops at its next layer
        boundary); their requests are rolled back when the interrupted results arrive, and scheduled again. For
        `req`, a new request, when it outranks them (`Scheduler.may_interrupt`), so its first token waits for no
        batch step; without one, whenever they can be (`Scheduler.interruptible`). False when none was sent."""
        plans = [entry.plan for entry in self._plans]
        if self._interrupting:  # one at a time: no plan is built until its results are in
            return False
        allowed = self.scheduler.interruptible(plans) if req is None else self.scheduler.may_interrupt(req, plans)
        if not allowed or not self.workers.interrupt(plans[0].step_id, plans[-1].step_id):
            return False
        self._interrupting = {plan.step_id for plan in plans}
        if req is not None:
            logger.info("%s interrupts steps %d..%d", req.req_id, plans[0].step_id, plans[-1].step_id)
        return True
