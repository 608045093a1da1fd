"""The engine loop: admit → schedule → send the plan → receive the result → stream deltas → free blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

from proto.wire import TokenLogprobs
from scheduler_node.detokenizer import IncrementalDetokenizer
from scheduler_node.request import Request, Status, StopConditions
from scheduler_node.scheduler import RequestOutput, Scheduler
from scheduler_node.tokenizer import ModelTokenizer
from scheduler_node.validation import RequestSpec
from scheduler_node.worker_link import WorkerLink, WorkerLost

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


class Engine:
    def __init__(self, scheduler: Scheduler, tokenizer: ModelTokenizer, link: WorkerLink) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.link = link
        self._sequences: dict[str, _Sequence] = {}
        self._by_request_id: dict[str, list[str]] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self.failed: str = ""  # set when the engine stopped for good

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def is_live(self, request_id: str) -> bool:
        return request_id in self._by_request_id

    def submit(self, spec: RequestSpec) -> RequestStream:
        if spec.request_id in self._by_request_id:
            raise KeyError(spec.request_id)
        if self.failed:
            raise RuntimeError(self.failed)
        stream = RequestStream(spec.request_id, spec.n)
        eos = frozenset() if spec.ignore_eos else self.tokenizer.eos_token_ids
        internal = []
        for index in range(spec.n):
            req_id = f"{spec.request_id}#{next(self._ids)}"
            sampling = spec.sampling
            if spec.n > 1 and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
            req = Request(req_id, spec.prompt_token_ids, sampling, StopConditions(spec.max_tokens, eos), spec.priority)
            detok = IncrementalDetokenizer(self.tokenizer, spec.prompt_token_ids, spec.stop)
            self._sequences[req_id] = _Sequence(stream, index, detok)
            self.scheduler.add(req)
            internal.append(req_id)
        self._by_request_id[spec.request_id] = internal
        self._wake.set()
        return stream

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
                if not self.scheduler.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                plan = self.scheduler.schedule()
                if not plan.num_scheduled_tokens and not self.scheduler.running and self.scheduler.waiting:
                    raise RuntimeError("waiting requests fit in no KV configuration")  # validation prevents it
                result = await self.link.step(plan)
                for out in self.scheduler.update(result):
                    self._on_output(out)
        except WorkerLost as exc:
            self._fail_all(f"worker lost: {exc}")
            raise
        except Exception as exc:
            logger.exception("engine loop failed")
            self._fail_all(f"engine failed: {exc}")
            raise

    def _on_output(self, out: RequestOutput) -> None:
        seq = self._sequences.get(out.request.req_id)
        if seq is None:
            return
        seq.detokenizer.add(out.new_token_ids)
        if seq.detokenizer.stopped and not out.request.finished:
            self.scheduler.finish(out.request.req_id, Status.FINISHED_STOPPED)
        self._emit(out.request, out.new_token_ids, out.logprobs)

    def _emit(self, req: Request, token_ids: list[int], logprobs: list[TokenLogprobs], error: str = "") -> None:
        seq = self._sequences[req.req_id]
        finished = req.finished
        delta = Delta(seq.index, token_ids, seq.detokenizer.delta(final=finished), logprobs=logprobs)
        if finished:
            delta.finish_reason = req.status.value
            delta.prompt_tokens = len(req.prompt_token_ids)
            delta.completion_tokens = len(req.output_token_ids)
            delta.error = error
            self._forget(req.req_id, seq.stream.request_id)
        if delta.token_ids or delta.text or finished:
            seq.stream.queue.put_nowait(delta)

    def _forget(self, req_id: str, request_id: str) -> None:
        del self._sequences[req_id]
        ids = self._by_request_id[request_id]
        ids.remove(req_id)
        if not ids:
            del self._by_request_id[request_id]

    def _fail_all(self, reason: str) -> None:
        self.failed = reason
        for req_id in list(self._sequences):
            req = self.scheduler.finish(req_id, Status.FINISHED_ERROR)
            if req is not None:
                self._emit(req, [], [], error=reason)
