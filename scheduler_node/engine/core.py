"""The engine core: the one loop every door drives (gRPC, the offline API, tests, benchmarks).

admit → schedule → send the plan → receive the result → hand the outputs on → free blocks. It keeps up to the
execution mode's plans in flight, applies their results in order, and interrupts and undoes plans for a request
that outranks them. What each step produced becomes text and deltas off this loop's thread, on the output side
(engine/output_side.py, engine/output_thread.py); failures (a lost rank, a failed step, deadlines) are handled in
engine/failures.py; what the doors ask (submit, abort, drain) in engine/intake.py. It reaches the workers only
through a transport (proto/transport.py): ZeroMQ to worker processes or in-process.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proto.transport import StepFailed, WorkerLost, WorkerTransport
from proto.wire import StepPlan, StepResult
from scheduler_node.core.kv_handoff import KVSource
from scheduler_node.core.request import Request, Status
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.collector import CollectorSchedule
from scheduler_node.engine.intake import Intake, first_done
from scheduler_node.engine.live_stats import LiveStats
from scheduler_node.engine.lora_registry import LoraRegistry
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.options import STEP_SECONDS_PER_TOKEN, EngineOptions
from scheduler_node.engine.output_side import OutputSide
from scheduler_node.engine.outputs import ErrorStatus
from scheduler_node.text.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    plan: StepPlan
    future: asyncio.Future[StepResult]
    sent: float  # perf_counter when built
    tokens: int  # the plan's scheduled tokens


class EngineCore(Intake, LiveStats):
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: ModelTokenizer,
        workers: WorkerTransport,
        options: EngineOptions | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.workers = workers
        self.options = options or EngineOptions()
        self.metrics = metrics or Metrics("minivllm")
        self.mode = scheduler.mode
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._interrupting: set[int] = set()  # steps interrupted and not answered yet: no plan is built meanwhile
        self.outputs = OutputSide(tokenizer, self.metrics, self._stopped_by_string)
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self.failed: str = ""  # set when the engine stopped for good
        self.draining = False  # no new requests; set by Drain and SIGTERM, never cleared
        self.gave_up = ""  # why requests are refused: a rank was lost and nobody rejoined in time
        self.collector = CollectorSchedule() if self.options.schedule_gc else None
        self._collected_at_idle = True  # nothing ran since the last idle collection
        self.loras: LoraRegistry | None = None  # the adapters served by name (None: LoRA is off)
        # Adapters a worker could not use (StepError.adapters), by id: a request naming one ends at once. Loading
        # the adapter again gives it a new id.
        self.unusable_loras: dict[int, str] = {}
        # Called after each step's result is applied: a replica publishing KV events sends the step's batch
        # (scheduler_node/engine/kv_publisher.py).
        self.after_step: Callable[[], None] | None = None
        self._lease_timer: asyncio.TimerHandle | None = None  # frees KV leases nobody pulled (core/kv_handoff.py)
        # Migrated sequences whose KV lease is not granted yet (engine/handoffs.py).
        self._granting: dict[bytes, tuple[Request, KVSource]] = {}
        self._leases_released = asyncio.Event()
        self._migrated_off: set[str] = set()

    # ---- the loop

    async def run(self) -> None:
        if self.collector is not None:
            self.collector.start()
        if self.options.output_thread:
            self.outputs.start()
        try:
            while True:
                if not self.workers.all_ready:
                    self._drop_inflight()
                    await self._recover()
                elif not self.scheduler.has_work and not self._inflight:
                    await self._wait_idle()
                else:
                    await self._step()
        except Exception as exc:
            logger.exception("engine loop failed")
            self.failed = f"engine failed: {exc}"
            self.end_all(self.failed, ErrorStatus.INTERNAL)
            raise
        finally:
            self.outputs.stop()

    async def _step(self) -> None:
        """Keep up to the mode's plans on the workers, then consume the oldest result."""
        await self._maybe_delay()
        self._fill_pipeline()
        if not self._inflight:
            if self.scheduler.waiting and not self.scheduler.running:
                self._end_unstartable()  # admission prevents it: a bug must not stop the engine
                return
            self._wake.clear()
            await self._woken()
            return
        head = self._inflight[0]
        try:
            result = await self._await_head(head)
        except WorkerLost as exc:
            logger.error("step %d did not complete: %s", head.plan.step_id, exc)
            self._drop_inflight()
            await self._recover()
            return
        except StepFailed as exc:
            self._drop_inflight()
            self._fail_step(head.plan, exc)
            return
        self._inflight.popleft()
        self._interrupting.discard(head.plan.step_id)
        if result.faulted:
            self._fail_faulted(result.faulted)
        if self.scheduler.quarantine.active:
            self._clear_suspects(head.plan, result)
        released = self.scheduler.leases.released
        outputs = self.scheduler.update(head.plan, result)
        if self.scheduler.leases.released != released:  # a request taken back pulled the KV it left here
            self._leases_released.set()
        self.outputs.step(outputs)
        if head.plan.kv_grants:
            self._granted(head.plan)
        self._arm_lease_timer()
        if self.after_step is not None:
            self.after_step()
        if head.tokens:
            m = self.metrics
            m.step_time.observe(time.perf_counter() - head.sent)
            m.iteration_tokens.observe(head.tokens)
            m.batch_utilization = head.tokens / self.scheduler.config.max_num_batched_tokens

    async def _wait_idle(self) -> None:
        """Nothing to do: wait for work (or a lost rank). Once idle for `idle_collection_delay_s`, the collector's
        idle collection runs (once per idle period)."""
        self._wake.clear()
        if self.collector is not None and not self._collected_at_idle and not self.outputs.request_of:
            if await self._woken(self.options.idle_collection_delay_s):
                return  # work came first: the collection waits for the next idle period
            self.collector.idle()
            self._collected_at_idle = True
        await self._woken()

    async def _woken(self, timeout: float | None = None) -> bool:
        """Wait until work arrives or a rank is lost, at most `timeout` seconds; False if the time ran out."""
        return await first_done(self._wake.wait(), self.workers.lost.wait(), timeout=timeout)

    def _fill_pipeline(self) -> None:
        while len(self._inflight) < self.mode.plans_in_flight and self.scheduler.has_work and not self._interrupting:
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
            self._inflight.append(_InFlight(plan, future, start, self.scheduler.scheduled_tokens(plan)))
            if plan.new_requests:
                self._collected_at_idle = False
                if self.collector is not None:
                    self.collector.admitted()  # once the plan is on its way

    async def _await_head(self, head: _InFlight) -> StepResult:
        """The oldest plan's result. While it runs and there is room for another plan, requests that arrive are
        scheduled at once (they do not wait for this step to end). Its deadline runs from now: the workers run
        plans in order, so it is the one they work on. Past it, the ranks that owe an answer are lost (a hung
        step, not a slow one)."""
        timeout = self.options.step_timeout + STEP_SECONDS_PER_TOKEN * head.tokens
        deadline = time.monotonic() + timeout
        reason = f"step {head.plan.step_id} ran past its {timeout:.0f} s deadline"
        while len(self._inflight) < self.mode.plans_in_flight and not self._interrupting and not head.future.done():
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
                self._fill_pipeline()
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

    def _past_deadline(self, head: _InFlight, reason: str) -> None:
        """The head's step hung: the ranks that owe it an answer are lost, and it fails with WorkerLost."""
        if head.future.done():
            return
        self.workers.declare_lost(reason)
        if not head.future.done():
            head.future.set_exception(WorkerLost(reason))

    def _drop_inflight(self) -> None:
        for entry in self._inflight:
            entry.future.cancel()
        self._inflight.clear()
        self._interrupting.clear()
        self._migrate_without_kv()  # a grant in a dropped plan may never have run

    def interrupt_in_flight(self, req: Request | None = None) -> bool:
        """Have the workers skip the compute of every plan in flight (the running step stops at its next layer
        boundary); their requests are rolled back when the interrupted results arrive, and scheduled again. For
        `req`, a new request, when it outranks them (`Scheduler.may_interrupt`), so its first token waits for no
        batch step; without one, whenever they can be (`Scheduler.interruptible`). False when none was sent."""
        plans = [entry.plan for entry in self._inflight]
        if self._interrupting:  # one at a time: no plan is built until its results are in
            return False
        allowed = self.scheduler.interruptible(plans) if req is None else self.scheduler.may_interrupt(req, plans)
        if not allowed or not self.workers.interrupt(plans[0].step_id, plans[-1].step_id):
            return False
        self._interrupting = {plan.step_id for plan in plans}
        if req is not None:
            logger.info("%s interrupts steps %d..%d", req.req_id, plans[0].step_id, plans[-1].step_id)
        return True

    async def _maybe_delay(self) -> None:
        """--scheduler-delay: with nothing in flight and a small batch, give more requests a moment to arrive."""
        s, delay = self.scheduler, self.options.scheduler_delay
        if not delay or self._inflight or not s.waiting or len(s.running) >= s.config.max_num_seqs // 2:
            return
        waited = time.monotonic() - min(r.arrival_time for r in s.waiting)
        if waited < delay:
            await asyncio.sleep(delay - waited)

    # ---- outputs

    def _note_scheduled(self, plan: StepPlan) -> None:
        for new in plan.new_requests:  # a request is scheduled for the first time as a new one
            req = self.scheduler.request_of(new.handle)
            if req is not None:
                self.outputs.scheduled(req.req_id)

    def _stopped_by_string(self, req_id: str) -> None:
        """The output side found a stop string (its final delta is out): the scheduler frees the sequence, and the
        workers are told to forget it."""
        self.scheduler.finish(req_id, Status.FINISHED_STOPPED)
        self._wake.set()
