"""The engine core: the one loop every door drives (gRPC, the offline API, tests, benchmarks).

admit → schedule → send the plan → receive the result → hand the outputs on → free blocks. The loop is here; the
rest is collaborators it builds and hands what each uses (the scheduler, the transport, the output side, the
options, the metrics, and this object's wake event to those that set it):

- PlansInFlight (engine/in_flight.py): the plans on the workers, sent while there is room, awaited in order under a
  deadline, interrupted and undone for a request that outranks them;
- Intake (engine/intake.py): what the doors ask (submit, abort, resize, drain) and whether a request can be admitted;
- Failures (engine/failures.py): a lost rank, a failed step, faulted requests, deadlines;
- Handoffs (engine/handoffs.py): KV leases and migration to another replica;
- LiveStats (engine/live_stats.py): the numbers read at scrape time;
- OutputSide (engine/output_side.py, engine/output_thread.py): each step's outputs become text and deltas off this
  loop's thread.

The doors know this class's methods, which answer through those objects; it reaches the workers only through a
transport (proto/transport.py): ZeroMQ to worker processes or in-process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from proto.memory_stats import KvPool
from proto.transport import StepFailed, WorkerLost, WorkerTransport
from proto.wire import StepResult
from scheduler_node.core.kv.leases import KVSource
from scheduler_node.core.lora_slots import LoraMemory
from scheduler_node.core.request import Request, RequestSpec, Status
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.collector import CollectorSchedule
from scheduler_node.engine.failures import Failures
from scheduler_node.engine.handoffs import Handoffs
from scheduler_node.engine.in_flight import InFlight, PlansInFlight
from scheduler_node.engine.intake import Intake, first_done
from scheduler_node.engine.live_stats import LiveStats
from scheduler_node.engine.lora_registry import LoraRegistry
from scheduler_node.engine.metrics import LiveSample, Metrics
from scheduler_node.engine.options import EngineOptions
from scheduler_node.engine.output_side import OutputSide
from scheduler_node.engine.outputs import DeltaSink, ErrorStatus, RequestStream
from scheduler_node.engine.serving_state import ServingState
from scheduler_node.text.images import ImagePrompts
from scheduler_node.text.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)


class EngineCore:
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
        self.wake = asyncio.Event()  # there is work, or the workers must be told something: this loop waits on it
        self.state = ServingState()
        self.outputs = OutputSide(tokenizer, self.metrics, self._stopped_by_string)
        self.collector = CollectorSchedule() if self.options.schedule_gc else None
        self.plans = PlansInFlight(scheduler, workers, self.metrics, self.outputs, self.collector, self.wake)
        self.handoffs = Handoffs(scheduler, workers, self.outputs, self.wake)
        self.failures = Failures(
            scheduler, workers, self.options, self.metrics, self.outputs, self.handoffs, self.state, self.wake
        )
        self.intake = Intake(
            scheduler,
            tokenizer,
            workers,
            self.options,
            self.outputs,
            self.state,
            self.handoffs,
            self.failures,
            self.plans.interrupt,
            self.wake,
        )
        self.stats = LiveStats(scheduler, workers, self.metrics)
        self.loras: LoraRegistry | None = None  # the adapters served by name (None: LoRA is off)
        self.images: ImagePrompts | None = None  # a multimodal model's image handling (None: text only)
        # Called after each step's result is applied: a replica publishing KV events sends the step's batch
        # (scheduler_node/engine/kv_publisher.py).
        self.after_step: Callable[[], None] | None = None

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
                    await self.failures.recover()
                elif not self.scheduler.has_work and not self.plans:
                    await self._wait_idle()
                else:
                    await self._step()
        except Exception as exc:
            logger.exception("engine loop failed")
            self.state.failed = f"engine failed: {exc}"
            self.failures.end_all(self.state.failed, ErrorStatus.INTERNAL)
            raise
        finally:
            self.outputs.stop()

    async def _step(self) -> None:
        """Keep up to the mode's plans on the workers, then consume the oldest result."""
        await self._maybe_delay()
        plans = self.plans
        plans.fill()
        if not plans:
            if self.scheduler.waiting and not self.scheduler.running:
                self.failures.end_unstartable()  # admission prevents it: a bug must not stop the engine
                return
            self.wake.clear()
            await self._woken()
            return
        head = plans.head
        try:
            result = await plans.await_head(self.options.step_timeout)
        except WorkerLost as exc:
            logger.error("step %d did not complete: %s", head.plan.step_id, exc)
            self._drop_inflight()
            await self.failures.recover()
            return
        except StepFailed as exc:
            self._drop_inflight()
            self.failures.fail_step(head.plan, exc)
            return
        plans.pop()
        self._apply(head, result)

    def _apply(self, head: InFlight, result: StepResult) -> None:
        """The oldest plan's result, in order: the requests it faulted fail first, then the scheduler applies the
        rest and the output side gets the step's outputs."""
        if result.faulted:
            self.failures.fail_faulted(result.faulted)
        if self.scheduler.quarantine.active:
            self.failures.clear_suspects(head.plan, result)
        self.outputs.step(self.scheduler.update(head.plan, result))
        self.handoffs.applied(head.plan)
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
        self.wake.clear()
        collector = self.collector
        if collector is not None and collector.admitted_since_idle and not self.outputs.request_of:
            if await self._woken(self.options.idle_collection_delay_s):
                return  # work came first: the collection waits for the next idle period
            collector.idle()
        await self._woken()

    async def _woken(self, timeout: float | None = None) -> bool:
        """Wait until work arrives or a rank is lost, at most `timeout` seconds; False if the time ran out."""
        return await first_done(self.wake.wait(), self.workers.lost.wait(), timeout=timeout)

    def _drop_inflight(self) -> None:
        self.plans.drop()
        self.handoffs.migrate_without_kv()  # a grant in a dropped plan may never have run

    async def _maybe_delay(self) -> None:
        """--scheduler-delay: with nothing in flight and a small batch, give more requests a moment to arrive."""
        s, delay = self.scheduler, self.options.scheduler_delay
        if not delay or self.plans or not s.waiting or len(s.running) >= s.config.max_num_seqs // 2:
            return
        waited = time.monotonic() - min(r.arrival_time for r in s.waiting)
        if waited < delay:
            await asyncio.sleep(delay - waited)

    def _stopped_by_string(self, req_id: str) -> None:
        """The output side found a stop string (its final delta is out): the scheduler frees the sequence, and the
        workers are told to forget it."""
        self.scheduler.finish(req_id, Status.FINISHED_STOPPED)
        self.wake.set()

    # ---- what the doors ask (engine/intake.py)

    def submit(self, spec: RequestSpec, deadline_s: float = 0.0) -> RequestStream:
        """Queue a request; with `deadline_s` > 0 it ends with DEADLINE_EXCEEDED that many seconds from now.
        Its deltas come in the stream returned, read on this loop."""
        return self.intake.submit(spec, deadline_s)

    def submit_to(self, spec: RequestSpec, stream: DeltaSink, deadline_s: float = 0.0) -> None:
        """`submit`, with the request's deltas put into `stream` (from the output thread if it is threadsafe)."""
        self.intake.submit_to(spec, stream, deadline_s)

    def abort(self, request_id: str) -> bool:
        return self.intake.abort(request_id)

    def resize_cache(self, num_blocks: int) -> int:
        return self.intake.resize_cache(num_blocks)

    def stop_admitting(self) -> None:
        self.intake.stop_admitting()

    async def drain(self, timeout: float | None, hurry: asyncio.Event | None = None) -> int:
        return await self.intake.drain(timeout, hurry)

    async def wait_idle(self) -> None:
        await self.intake.wait_idle()

    def unavailable(self) -> str:
        """Why a new request cannot be admitted now ("" when it can)."""
        return self.state.refusal()

    def queue_full(self, n: int) -> bool:
        return self.intake.queue_full(n)

    def is_live(self, request_id: str) -> bool:
        return self.intake.is_live(request_id)

    @property
    def num_live(self) -> int:
        return self.outputs.num_live

    @property
    def max_model_len(self) -> int:
        return self.intake.max_model_len

    @property
    def max_kv_blocks(self) -> int:
        return self.intake.max_kv_blocks

    @property
    def compact_tokens(self) -> int:
        return self.intake.compact_tokens

    @property
    def failed(self) -> str:
        """Why the engine stopped for good ("" while it runs)."""
        return self.state.failed

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def gave_up(self) -> str:
        """Why requests are refused: a rank was lost and nobody rejoined in time ("" otherwise)."""
        return self.state.gave_up

    def interrupt_in_flight(self, req: Request | None = None) -> bool:
        return self.plans.interrupt(req)

    def end_all(self, reason: str, status: ErrorStatus) -> None:
        self.failures.end_all(reason, status)

    # ---- another replica's (engine/handoffs.py)

    def migrate(self, request_ids: Collection[str] | None = None) -> int:
        return self.handoffs.migrate(request_ids)

    def kv_source(self, request_id: str) -> KVSource | None:
        return self.handoffs.kv_source(request_id)

    def release_kv(self, request_id: str) -> bool:
        return self.handoffs.release_kv(request_id)

    def takes_back(self, request_id: str) -> bool:
        return self.handoffs.takes_back(request_id)

    async def migrations_settled(self, timeout: float | None) -> bool:
        return await self.handoffs.migrations_settled(timeout)

    # ---- read at scrape time (engine/live_stats.py)

    def kv_pools(self) -> list[KvPool]:
        return self.stats.kv_pools()

    def lora_memory(self) -> list[LoraMemory]:
        return self.stats.lora_memory(self.loras is not None)

    def live_metrics(self) -> LiveSample:
        return self.stats.live_metrics(self.loras is not None)
