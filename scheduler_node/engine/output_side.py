"""The engine's output side, on its event loop: which requests are live, and the hand-off of their outputs.

It keeps the maps of request ids the engine needs (a request's sequences, its deadline, each sequence's arrival
until it is first scheduled) and hands every step's outputs, and every sequence the engine ends, to the output
processor (engine/output_thread.py) in one batch per step, on its thread once `start` ran. What comes back runs
here, on the loop: the deltas of streams read on it, and the sequences a stop string ended, which the engine's
`on_stop` finishes on the scheduler (their final delta went out already). `idle` is set when no request is live
and the last one's final delta is out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from scheduler_node.core.kv.leases import KVSource
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import Request, RequestSpec
from scheduler_node.core.scheduler import RequestOutput
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.output_thread import (
    Added,
    Delivery,
    Ending,
    Item,
    Migrating,
    OutputProcessor,
    OutputThread,
    SequenceOutput,
)
from scheduler_node.engine.outputs import DeltaSink, EngineError
from scheduler_node.text.detokenizer import IncrementalDetokenizer
from scheduler_node.text.tokenizer import ModelTokenizer


class OutputSide:
    def __init__(self, tokenizer: ModelTokenizer, metrics: Metrics, on_stop: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.on_stop = on_stop  # a stop string ended this sequence: the scheduler finishes it
        self.requests: dict[str, list[str]] = {}  # request id -> its live sequences' ids
        self.request_of: dict[str, str] = {}  # live sequence id -> its request's id
        self.deadlines: dict[str, asyncio.TimerHandle] = {}
        self.migratable: set[str] = set()  # live requests whose door takes a "migrated" end
        self._unscheduled: dict[str, float] = {}  # sequence id -> arrival, until it is first scheduled
        self.idle = asyncio.Event()  # set while no request is live (and every final delta is out)
        self.idle.set()
        self.processor = OutputProcessor(metrics)
        self._thread: OutputThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Item] = []

    @property
    def num_live(self) -> int:
        """Requests not ended yet."""
        return len(self.requests)

    # ---- the thread

    def start(self) -> None:
        """From now on the output path runs on its own thread (until `stop`)."""
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = OutputThread(self.processor, self._deliver_threadsafe)

    def stop(self) -> None:
        """Back to processing inline, once the thread processed what it was sent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()

    # ---- requests

    def add(self, spec: RequestSpec, sequences: list[Request], sink: DeltaSink) -> None:
        """Follow a request's sequences (before any output of them); a migrated request's continue where they
        stopped (`spec.resume`, in the order of `sequences`)."""
        now = time.monotonic()
        ids = [req.req_id for req in sequences]
        self.requests[spec.request_id] = ids
        if spec.migratable:
            self.migratable.add(spec.request_id)
        resumes = spec.resume or [None] * len(sequences)
        for index, (req, resume) in enumerate(zip(sequences, resumes)):
            if resume is None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, spec.prompt_token_ids, spec.stop, req.stop.may_stop
                )
                wants = index == 0 and spec.sampling.prompt_logprobs is not None
                sequence = SequenceOutput(sink, index, detokenizer, len(spec.prompt_token_ids), now, wants)
                if not (sink.incremental or detokenizer.stop or wants or spec.sampling.logprobs is not None):
                    sequence.held = []  # nothing to find or send per step: its tokens wait for its end
            else:
                sequence = self._resumed(spec, req, resume, sink, now)
            self._pending.append(Added(req.req_id, sequence))
            self.request_of[req.req_id] = spec.request_id
            self._unscheduled[req.req_id] = now
        self.idle.clear()

    def _resumed(
        self, spec: RequestSpec, req: Request, resume: SequenceResume, sink: DeltaSink, now: float
    ) -> SequenceOutput:
        """A migrated sequence's output side: its text goes on from the state's, its usage counts what it made
        where it ran, and its next token is not a first token (no second time to first token)."""
        outputs = resume.output_token_ids
        pending = resume.pending_token_ids or []
        context = spec.prompt_token_ids + outputs[: len(outputs) - len(pending)]
        detokenizer = IncrementalDetokenizer(self.tokenizer, context, spec.stop, req.stop.may_stop)
        detokenizer.resume(len(outputs), resume.held_text, pending)
        sequence = SequenceOutput(sink, resume.index, detokenizer, len(spec.prompt_token_ids), now, False)
        sequence.num_tokens = len(outputs)
        if resume.started:
            sequence.last_token_at = now
            sequence.cached_tokens = resume.cached_tokens
        return sequence

    def migrate(self, req: Request, kv_source: KVSource | None = None) -> None:
        """The engine moved a live sequence off this replica (its blocks freed, or leased to its target at
        `kv_source`): its state, in its last delta."""
        if req.req_id not in self.request_of:
            return
        self._forget(req.req_id)
        prompt, outputs = len(req.prompt_token_ids), list(req.output_token_ids)
        self._pending.append(Migrating(req.req_id, outputs, prompt, req.num_cached_tokens, kv_source))
        self.flush()

    def scheduled(self, req_id: str) -> None:
        """A sequence was scheduled for the first time since it arrived (or not: a resumed one)."""
        arrival = self._unscheduled.pop(req_id, None)
        if arrival is not None:
            self.metrics.queue_time.observe(time.monotonic() - arrival)

    def step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs: the sequences they ended are no longer live; the rest is the output thread's."""
        for out in outputs:
            if out.finish_reason is not None:
                self._forget(out.request.req_id)
        if outputs:
            self._pending.append(outputs)
        self.flush()

    def end(self, req: Request, error: EngineError | None = None) -> None:
        """The engine ended a live sequence (abort, deadline, error): its final delta."""
        if req.req_id not in self.request_of:
            return
        self._forget(req.req_id)
        embedding = req.embedding() if req.sampling.pooling else None
        reason, completion = req.status.finish_reason, len(req.output_token_ids)
        self._pending.append(Ending(req.req_id, reason, completion, error, req.num_cached_tokens, embedding))
        self.flush()

    def flush(self) -> None:
        items, self._pending = self._pending, []
        if not items:
            return
        if self._thread is not None:
            self._thread.send(items)
        else:
            self._deliver(self.processor.process(items))

    def _forget(self, req_id: str) -> None:
        request_id = self.request_of.pop(req_id, None)
        if request_id is None:
            return
        self._unscheduled.pop(req_id, None)
        ids = self.requests[request_id]
        ids.remove(req_id)
        if not ids:
            del self.requests[request_id]
            self.migratable.discard(request_id)
            expire = self.deadlines.pop(request_id, None)
            if expire is not None:
                expire.cancel()

    # ---- what comes back

    def _deliver_threadsafe(self, delivery: Delivery) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, delivery)

    def _deliver(self, delivery: Delivery) -> None:
        """On the loop: the batch's deltas into their streams, then the sequences a stop string ended."""
        for sink, delta in delivery.deltas:
            sink.put(delta)
        for req_id in delivery.stopped:
            if req_id in self.request_of:
                self._forget(req_id)
                self.on_stop(req_id)
        if not self.requests:
            self.idle.set()
