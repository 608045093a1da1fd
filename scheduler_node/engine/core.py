"""The engine loop: admit → schedule → send the plan → receive the result → stream deltas → free blocks."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from proto.wire import StepPlan, StepResult, TokenLogprobs
from scheduler_node.api.validation import RequestSpec
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import RequestOutput, Scheduler
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.worker_link import StepFailed, WorkerLink, WorkerLost
from scheduler_node.text.detokenizer import IncrementalDetokenizer
from scheduler_node.text.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Delta:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str = ""  # "" while running; stop | length | abort | error
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""  # set with finish_reason "error": why the request failed
    code: str = ""  # with finish_reason "error": the gRPC status name (UNAVAILABLE, DEADLINE_EXCEEDED, ...)


class RequestStream:
    """The deltas of one client request (all n sequences), in order."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.unfinished = n

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        while self.unfinished:
            delta = await self.queue.get()
            if delta.finish_reason:
                self.unfinished -= 1
            yield delta


@dataclass(slots=True)
class _Sequence:
    stream: RequestStream
    index: int
    detokenizer: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    scheduled: bool = False
    last_token_at: float = 0.0  # 0 until the first token


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: ModelTokenizer,
        link: WorkerLink,
        metrics: Metrics | None = None,
        rejoin_timeout: float = 60.0,
        max_waiting_requests: int = 0,
        async_scheduling: bool = True,
        scheduler_delay: float = 0.0,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.link = link
        self.metrics = metrics or Metrics("minivllm")
        self.rejoin_timeout = rejoin_timeout  # seconds a lost rank may take to come back
        self.max_waiting_requests = max_waiting_requests  # 0: unbounded
        self.plans_in_flight = plans_in_flight(async_scheduling, scheduler.config.pipeline_parallel_size)
        self.scheduler_delay = scheduler_delay  # seconds to wait for more arrivals before a small batch
        self._inflight: collections.deque[tuple[StepPlan, asyncio.Future[StepResult], float]] = collections.deque()
        self._interrupting: set[int] = set()  # steps interrupted and not answered yet: no plan is built meanwhile
        self._sequences: dict[str, _Sequence] = {}
        self._by_request_id: dict[str, list[str]] = {}
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is live
        self._idle.set()
        self.failed: str = ""  # set when the engine stopped for good
        self.draining = False  # no new requests; set by Drain and SIGTERM, never cleared
        self.gave_up = ""  # why requests are refused: a rank was lost and nobody rejoined in time

    def unavailable(self) -> str:
        """Why a new request cannot be admitted now ("" when it can)."""
        if self.draining:
            return "the server is draining: it finishes what runs and takes nothing new"
        return self.failed or self.gave_up

    def queue_full(self, n: int) -> bool:
        """Would `n` more sequences overflow --max-waiting-requests?"""
        limit = self.max_waiting_requests
        return bool(limit) and len(self.scheduler.waiting) + n > limit

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def is_live(self, request_id: str) -> bool:
        return request_id in self._by_request_id

    def submit(self, spec: RequestSpec, deadline_s: float = 0.0) -> RequestStream:
        """Queue a request; with `deadline_s` > 0 it ends with DEADLINE_EXCEEDED that many seconds from now."""
        if spec.request_id in self._by_request_id:
            raise KeyError(spec.request_id)
        if self.failed:
            raise RuntimeError(self.failed)
        stream = RequestStream(spec.request_id, spec.n)
        eos = frozenset() if spec.ignore_eos else self.tokenizer.eos_token_ids
        internal = []
        sequences: list[Request] = []
        for index in range(spec.n):
            req_id = f"{spec.request_id}#{next(self._ids)}"
            sampling = spec.sampling
            if spec.n > 1 and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
            stop = StopConditions(spec.max_tokens, eos)
            sequences.append(
                Request(req_id, spec.prompt_token_ids, sampling, stop, spec.priority, cache_salt=spec.cache_salt)
            )
            detok = IncrementalDetokenizer(self.tokenizer, spec.prompt_token_ids, spec.stop)
            self._sequences[req_id] = _Sequence(stream, index, detok)
            internal.append(req_id)
        self.scheduler.add(sequences[0], forks=sequences[1:])  # siblings share the prompt's blocks
        self._maybe_interrupt(sequences[0])
        self._by_request_id[spec.request_id] = internal
        if deadline_s > 0:
            expire = asyncio.get_running_loop().call_later(deadline_s, self._expire, spec.request_id, deadline_s)
            self._deadlines[spec.request_id] = expire
        self._idle.clear()
        self._wake.set()
        return stream

    def resize_cache(self, num_blocks: int) -> int:
        """Change the usable KV blocks; the block moves run on the workers before the next step."""
        moved = self.scheduler.resize(num_blocks)
        self._wake.set()
        return moved

    def abort(self, request_id: str) -> bool:
        ids = self._by_request_id.get(request_id)
        if ids is None:
            return False
        for req_id in list(ids):
            req = self.scheduler.finish(req_id, Status.FINISHED_ABORTED)
            if req is not None:
                self._emit(req, [], [])
        self._wake.set()  # tell the workers to forget them
        return True

    async def run(self) -> None:
        try:
            while True:
                if not self.link.all_ready:
                    self._drop_inflight()
                    await self._recover()
                elif not self.scheduler.has_work and not self._inflight:
                    self._wake.clear()
                    await _first(self._wake.wait(), self.link.lost.wait())
                else:
                    await self._step()
        except Exception as exc:
            logger.exception("engine loop failed")
            self.failed = f"engine failed: {exc}"
            self.end_all(self.failed, "INTERNAL")
            raise

    async def _step(self) -> None:
        """Keep up to `plans_in_flight` plans on the workers, then consume the oldest result."""
        await self._maybe_delay()
        while len(self._inflight) < self.plans_in_flight and self.scheduler.has_work and not self._interrupting:
            start = time.perf_counter()
            plan = self.scheduler.schedule()
            if not _has_work_for_workers(plan):
                break  # every running request waits for an in-flight result
            self.metrics.schedule_time.observe(time.perf_counter() - start)
            self._note_scheduled(plan)
            try:
                future = self.link.submit(plan)
            except WorkerLost as exc:
                logger.error("step %d could not be sent: %s", plan.step_id, exc)
                self._drop_inflight()
                await self._recover()
                return
            self._inflight.append((plan, future, start))
        if not self._inflight:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("waiting requests fit in no KV configuration")  # validation prevents it
            self._wake.clear()
            await _first(self._wake.wait(), self.link.lost.wait())
            return
        plan, future, start = self._inflight[0]
        try:
            result = await future
        except WorkerLost as exc:
            logger.error("step %d did not complete: %s", plan.step_id, exc)
            self._drop_inflight()
            await self._recover()
            return
        except StepFailed as exc:
            self._drop_inflight()
            self._fail_step(plan, str(exc))
            return
        self._inflight.popleft()
        self._interrupting.discard(plan.step_id)
        for out in self.scheduler.update(plan, result):
            self._on_output(out)
        if plan.num_scheduled_tokens:
            m = self.metrics
            m.step_time.observe(time.perf_counter() - start)
            m.iteration_tokens.observe(plan.total_tokens)
            m.batch_utilization = plan.total_tokens / self.scheduler.config.max_num_batched_tokens

    def _drop_inflight(self) -> None:
        for _, future, _ in self._inflight:
            future.cancel()
        self._inflight.clear()
        self._interrupting.clear()

    def _maybe_interrupt(self, req: Request) -> None:
        """A request that outranks every request of the plans in flight has a lone worker skip their compute
        (the running step stops at its next layer boundary), so its first token waits for no batch step.
        Their requests are rolled back when the interrupted results arrive, and scheduled again."""
        if self._interrupting or not self._inflight:
            return
        plans = [plan for plan, _, _ in self._inflight]
        if self.scheduler.may_interrupt(req, plans) and self.link.interrupt(plans[0].step_id, plans[-1].step_id):
            logger.info("%s interrupts steps %d..%d", req.req_id, plans[0].step_id, plans[-1].step_id)
            self._interrupting = {plan.step_id for plan in plans}

    async def _maybe_delay(self) -> None:
        """--scheduler-delay: with nothing in flight and a small batch, give more requests a moment to arrive."""
        s = self.scheduler
        if not self.scheduler_delay or self._inflight or not s.waiting or len(s.running) >= s.config.max_num_seqs // 2:
            return
        waited = time.monotonic() - min(r.arrival_time for r in s.waiting)
        if waited < self.scheduler_delay:
            await asyncio.sleep(self.scheduler_delay - waited)

    async def _recover(self) -> None:
        """A rank is lost with its KV: requeue everything, wait for a replacement, resume by recompute.

        If none joins within the rejoin timeout, every live request ends with UNAVAILABLE and new ones are
        refused until the ranks are complete again."""
        reason = self.link.lost_reason or "a rank is not ready"
        self.metrics.worker_losses.inc()
        running = self.scheduler.requeue_all()
        if self.draining:
            self.end_all(f"{reason} while draining", "UNAVAILABLE")
        else:
            logger.warning(
                "%s: %d running request(s) back to waiting; waiting up to %g s for a replacement worker",
                reason,
                running,
                self.rejoin_timeout,
            )
            if await self.link.wait_ready(self.rejoin_timeout):
                logger.info("every rank is ready; resuming %d request(s) by recompute", self.scheduler.num_unfinished)
                return
        self.gave_up = f"{reason}, and no worker rejoined within {self.rejoin_timeout:g} s"
        logger.error("%s: failing %d live request(s)", self.gave_up, len(self._by_request_id))
        self.end_all(self.gave_up, "UNAVAILABLE")
        await self.link.wait_ready(None)
        self.scheduler.requeue_all()  # start from a clean slate: no notices for the old workers
        self.gave_up = ""
        self.link.changed.set()  # health: SERVING again
        logger.info("every rank is ready again; serving")

    def _fail_step(self, plan: StepPlan, reason: str) -> None:
        """A worker could not run the plan: its requests fail, the rest are recomputed (worker state is suspect)."""
        logger.error("%s; failing the %d request(s) of that step", reason, len(plan.num_scheduled_tokens))
        for req_id in plan.num_scheduled_tokens:
            req = self.scheduler.finish(req_id, Status.FINISHED_ERROR)
            if req is not None and req_id in self._sequences:
                self._emit(req, [], [], error=reason, code="INTERNAL")
        self.scheduler.requeue_all()

    def _note_scheduled(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for req_id in plan.num_scheduled_tokens:
            seq = self._sequences.get(req_id)
            if seq is not None and not seq.scheduled:
                seq.scheduled = True
                self.metrics.queue_time.observe(now - seq.arrival)

    def _expire(self, request_id: str, deadline_s: float) -> None:
        self._deadlines.pop(request_id, None)
        for req_id in list(self._by_request_id.get(request_id, [])):
            req = self.scheduler.finish(req_id, Status.FINISHED_ERROR)
            if req is not None:
                error = f"deadline_s: {deadline_s:g} s passed before the request finished"
                self._emit(req, [], [], error=error, code="DEADLINE_EXCEEDED")
        self._wake.set()  # tell the workers to forget them

    async def drain(self, timeout: float | None, hurry: asyncio.Event | None = None) -> int:
        """Take no new requests; wait until every live one finished, `timeout` seconds passed, or `hurry` is
        set. Returns how many are still live."""
        if not self.draining:
            self.draining = True
            logger.info("draining: %d live request(s)", len(self._by_request_id))
            self.link.changed.set()  # health: NOT_SERVING
        waits = [self._idle.wait()] + ([hurry.wait()] if hurry is not None else [])
        try:
            await asyncio.wait_for(_first(*waits), timeout)
        except asyncio.TimeoutError:
            pass
        return len(self._by_request_id)

    def _on_output(self, out: RequestOutput) -> None:
        seq = self._sequences.get(out.request.req_id)
        if seq is None:
            return
        seq.detokenizer.add(out.new_token_ids)
        if seq.detokenizer.stopped and not out.request.finished:
            self.scheduler.finish(out.request.req_id, Status.FINISHED_STOPPED)
        self._emit(out.request, out.new_token_ids, out.logprobs)

    def _emit(
        self, req: Request, token_ids: list[int], logprobs: list[TokenLogprobs], error: str = "", code: str = ""
    ) -> None:
        seq = self._sequences[req.req_id]
        if token_ids:
            self._observe_tokens(seq, req, len(token_ids))
        finished = req.finished
        delta = Delta(seq.index, token_ids, seq.detokenizer.delta(final=finished), logprobs=logprobs)
        if finished:
            delta.finish_reason = req.status.value
            delta.prompt_tokens = len(req.prompt_token_ids)
            delta.completion_tokens = len(req.output_token_ids)
            delta.error = error
            delta.code = code
            self.metrics.finished(req.status.value, None if error else time.monotonic() - seq.arrival)
            self._forget(req.req_id, seq.stream.request_id)
        if delta.token_ids or delta.text or finished:
            seq.stream.queue.put_nowait(delta)

    def _forget(self, req_id: str, request_id: str) -> None:
        del self._sequences[req_id]
        ids = self._by_request_id[request_id]
        ids.remove(req_id)
        if not ids:
            del self._by_request_id[request_id]
            expire = self._deadlines.pop(request_id, None)
            if expire is not None:
                expire.cancel()
            if not self._by_request_id:
                self._idle.set()

    def _observe_tokens(self, seq: _Sequence, req: Request, n: int) -> None:
        m, now = self.metrics, time.monotonic()
        m.generation_tokens.inc(n)
        if not seq.last_token_at:
            m.ttft.observe(now - seq.arrival)
            if seq.index == 0:
                m.prompt_tokens.inc(len(req.prompt_token_ids))
        else:
            for _ in range(n):
                m.itl.observe((now - seq.last_token_at) / n)
        seq.last_token_at = now

    def end_all(self, reason: str, code: str) -> None:
        """End every live request with an error (`code`: the gRPC status name) and free its blocks."""
        for req_id in list(self._sequences):
            req = self.scheduler.finish(req_id, Status.FINISHED_ERROR)
            if req is not None:
                self._emit(req, [], [], error=reason, code=code)
        self._wake.set()


def plans_in_flight(async_scheduling: bool, pipeline_parallel_size: int) -> int:
    """With one stage, async scheduling sends plan N+1 while the workers run step N (they feed their own sampled
    tokens forward; the scheduler counts them as in flight and drops those of stopped requests). With P stages,
    P plans on disjoint requests: stage s runs plan N+1 while stage s+1 runs plan N."""
    if not async_scheduling:
        return 1
    return pipeline_parallel_size if pipeline_parallel_size > 1 else 2


def _has_work_for_workers(plan: StepPlan) -> bool:
    return bool(
        plan.num_scheduled_tokens
        or plan.finished_req_ids
        or plan.preempted_req_ids
        or plan.block_copies
        or plan.swap_out
        or plan.swap_in
    )


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of these finishes; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
