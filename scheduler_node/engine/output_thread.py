"""The output path, off the engine's thread: detokenize, find stop strings, build deltas, feed the streams.

The engine's thread schedules, sends plans and applies results; what each step produced for each sequence is
turned into text and deltas here, on a thread of its own, fed one batch per step (issue 24: on the engine's
thread this was three quarters of its host cost). The thread owns every sequence's output state; it learns of a
sequence by an `Added` item and forgets it when it ends. Deltas for sinks read on the event loop (the servers'
streams) go there in one call per batch; a `threadsafe` sink (the offline LLM's collectors) gets them here. A
sink that is not `incremental` (those collectors again) gets a sequence with nothing to look at per step (no stop
strings, no logprobs) in one delta at its end: its tokens wait in `SequenceOutput.held`, counted and timed.

A stop string is found here, after the engine went on: the sequence ends at once on this side (its text cut, its
final delta sent, later tokens dropped), and its id goes back to the engine's loop with the batch's deltas, where
the scheduler finishes it and frees its blocks (`OutputSide`). Its output is what it would have been had the
engine stopped it at that step; only its blocks are freed a step or two later.

Without a thread (`process` called on the loop, as tests that drive no engine loop do) the same code runs inline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_node.core.kv.leases import KVSource
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import FinishReason
from scheduler_node.core.scheduler import RequestOutput
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.outputs import Delta, DeltaSink, EngineError
from scheduler_node.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceOutput:
    """The output side of one sequence: where its deltas go, its text so far (stop strings cut it), its timing."""

    sink: DeltaSink
    index: int  # which of its request's n sequences
    detokenizer: IncrementalDetokenizer
    prompt_tokens: int
    arrival: float
    prompt_logprobs: bool  # sequence 0 of a request that asked for them: they go with its first tokens
    last_token_at: float = 0.0  # 0 until the first token
    num_tokens: int = 0
    cached_tokens: int | None = None  # a migrated sequence's, from where it started (None: the scheduler's)
    # For a sink that is not incremental, when no step's tokens need looking at (no stop strings, no logprobs):
    # its tokens so far, not detokenized yet; they go out with its last delta (None: a delta per step).
    held: list[int] | None = None


@dataclass(slots=True)
class Added:
    """A sequence to follow (before any output of it)."""

    req_id: str
    sequence: SequenceOutput


@dataclass(slots=True)
class Ending:
    """A sequence the engine ended (abort, deadline, error), not its own tokens."""

    req_id: str
    finish_reason: FinishReason
    completion_tokens: int
    error: EngineError | None = None
    cached_tokens: int = 0
    embedding: list[float] | None = None


@dataclass(slots=True)
class Migrating:
    """A sequence the engine moved off this replica (Drain with migrate): its state goes in its last delta."""

    req_id: str
    output_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    kv_source: KVSource | None = None  # where its KV waits for the target (None: it recomputes)


Item = Added | Ending | Migrating | list[RequestOutput]  # a list: one step's outputs


@dataclass(slots=True)
class Delivery:
    """What a batch brings the event loop: the deltas of sinks read there, and the sequences a stop string ended."""

    deltas: list[tuple[DeltaSink, Delta]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    ended: int = 0  # sequences that ended in the batch

    def __bool__(self) -> bool:
        return bool(self.deltas or self.stopped or self.ended)


class OutputProcessor:
    """Every live sequence's output state, and the work of turning steps into deltas (on one thread at a time)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.sequences: dict[str, SequenceOutput] = {}

    def process(self, items: list[Item]) -> Delivery:
        delivery = Delivery()
        for item in items:
            if isinstance(item, list):
                self._step(item, delivery)
            elif isinstance(item, Added):
                self.sequences[item.req_id] = item.sequence
            elif isinstance(item, Migrating):
                self._migrate(item, delivery)
            else:
                self._end(item, delivery)
        return delivery

    def _step(self, outputs: list[RequestOutput], delivery: Delivery) -> None:
        """Each sequence's new tokens (one clock reading for the step); counted once. The loop runs once per
        sequence per step: what it calls is looked up once; a held sequence's step is an extend and its timing,
        and the common streamed case (one token, no stop, a sequence that already streams) calls nothing but the
        detokenizer and the sink."""
        now, tokens, sequences = time.monotonic(), 0, self.sequences
        to_loop, stop = delivery.deltas, FinishReason.STOP
        for out in outputs:
            req_id = out.request.req_id
            seq = sequences.get(req_id)
            if seq is None:
                continue  # ended here already (a stop string, an abort): later tokens are not its output
            token_ids, reason = out.new_token_ids, out.finish_reason
            held = seq.held
            if held is not None:
                if reason is None:  # a sequence read whole: its tokens wait, counted and timed
                    if n := len(token_ids):
                        held += token_ids
                        tokens += n
                        self._timed(seq, n, now)
                    continue
                held = self._release(seq)  # it ends: its text is made in one go, its tokens lead its last delta
            detokenizer = seq.detokenizer
            if len(token_ids) > 1 and detokenizer.stop:  # several tokens (accepted proposals) and stop strings
                token_ids = _until_stop_string(token_ids, out.stopped_by_token, detokenizer)
            else:
                detokenizer.add(token_ids[:-1] if out.stopped_by_token else token_ids)  # a stop token is not text
            n = len(token_ids)
            # A stop string: the engine learns it from the delivery. One that came before the token that ended the
            # request in the same step (eos, max_tokens) ends it instead.
            stop_string = detokenizer.stopped and (reason is None or n < len(out.new_token_ids))
            if stop_string:
                reason = stop
                delivery.stopped.append(req_id)
            if n:
                tokens += n
                self._timed(seq, n, now)
            text = detokenizer.delta(final=reason is not None)
            delta = Delta(seq.index, held + token_ids if held else token_ids, text, logprobs=out.logprobs)
            if seq.prompt_logprobs and n:
                delta.prompt_logprobs = list(out.request.prompt_logprobs)  # complete once the first token is sampled
                seq.prompt_logprobs = False
            if reason is not None:
                del sequences[req_id]
                if stop_string:  # what update() copies for an ending, known here
                    out.num_output_tokens, out.cached_tokens = seq.num_tokens, out.request.num_cached_tokens
                self._final(delta, seq, reason, out.num_output_tokens, out.cached_tokens, out.embedding, delivery)
            elif not (n or text or held):
                continue
            sink = seq.sink
            if sink.threadsafe:
                sink.put(delta)
            else:
                to_loop.append((sink, delta))
        if tokens:
            self.metrics.generation_tokens.inc(tokens)

    def _end(self, ending: Ending, delivery: Delivery) -> None:
        seq = self.sequences.pop(ending.req_id, None)
        if seq is None:
            return  # it ended here first
        delta = Delta(seq.index, self._release(seq), seq.detokenizer.delta(final=True), error=ending.error)
        reason, completion = ending.finish_reason, ending.completion_tokens
        self._final(delta, seq, reason, completion, ending.cached_tokens, ending.embedding, delivery)
        self._put(seq.sink, delta, delivery)

    def _migrate(self, item: Migrating, delivery: Delivery) -> None:
        """The sequence's last delta here: no text (what is held back travels in the state), finish_reason
        MIGRATED. Its earlier tokens were processed before this item, so the state matches what its client has."""
        seq = self.sequences.pop(item.req_id, None)
        if seq is None:
            return  # a stop string ended it first: its final delta is out
        if released := self._release(seq):  # what its sink has not had yet, before the state that follows it
            self._put(seq.sink, Delta(seq.index, released, seq.detokenizer.delta(final=False)), delivery)
        held, pending = seq.detokenizer.held()
        cached = item.cached_tokens if seq.cached_tokens is None else seq.cached_tokens
        state = SequenceResume(
            seq.index, item.output_token_ids, held, pending, item.prompt_tokens, cached, item.kv_source
        )
        delta = Delta(seq.index, [], "", FinishReason.MIGRATED, migrated=state)
        delivery.ended += 1
        self._put(seq.sink, delta, delivery)

    def _final(
        self,
        delta: Delta,
        seq: SequenceOutput,
        reason: FinishReason,
        completion_tokens: int,
        cached_tokens: int,
        embedding: list[float] | None,
        delivery: Delivery,
    ) -> None:
        """A sequence's last delta: how it ended, its usage (and its embedding)."""
        delta.finish_reason = reason
        delta.prompt_tokens = seq.prompt_tokens
        delta.cached_tokens = cached_tokens if seq.cached_tokens is None else seq.cached_tokens
        delta.embedding = embedding
        delta.completion_tokens = completion_tokens
        self.metrics.finished(reason, None if delta.error else time.monotonic() - seq.arrival)
        delivery.ended += 1

    @staticmethod
    def _release(seq: SequenceOutput) -> list[int]:
        """A sequence's held tokens, into its detokenizer at once (its text as if they came one by one: the
        tokenizer's stream decodes a run of tokens as their joint text); from now on its deltas go per step."""
        held, seq.held = seq.held, None
        if held:
            seq.detokenizer.add(held)
        return held or []

    @staticmethod
    def _put(sink: DeltaSink, delta: Delta, delivery: Delivery) -> None:
        if sink.threadsafe:
            sink.put(delta)
        else:
            delivery.deltas.append((sink, delta))

    def _timed(self, seq: SequenceOutput, n: int, now: float) -> None:
        """`n` tokens of `seq` came out at `now`: its count, and its first token's time or the gap per token."""
        seq.num_tokens += n
        if seq.last_token_at:
            self.metrics.itl.observe_n((now - seq.last_token_at) / n, n)
        else:
            self.metrics.ttft.observe(now - seq.arrival)
            if seq.index == 0:
                self.metrics.prompt_tokens.inc(seq.prompt_tokens)
        seq.last_token_at = now


class OutputThread:
    """Runs an OutputProcessor on a thread: `send` hands it a batch; each batch's delivery goes to `deliver`
    (which runs it on the event loop)."""

    def __init__(self, processor: OutputProcessor, deliver: Callable[[Delivery], None]) -> None:
        self.processor = processor
        self.deliver = deliver
        self._queue: queue.SimpleQueue[list[Item] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="minivllm-output", daemon=True)
        self._thread.start()

    def send(self, items: list[Item]) -> None:
        self._queue.put(items)

    def stop(self) -> None:
        """Process what was sent, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (items := self._queue.get()) is not None:
            while not self._queue.empty():  # batches that queued up meanwhile: one delivery for all
                more = self._queue.get()
                if more is None:
                    self._process(items)
                    return
                items += more
            self._process(items)

    def _process(self, items: list[Item]) -> None:
        try:
            delivery = self.processor.process(items)
            if delivery:
                self.deliver(delivery)
        except Exception:  # a bug here must not end the thread: every later request would hang
            logger.exception("the output thread failed on a batch")


def _until_stop_string(ids: list[int], stopped_by_token: bool, detokenizer: IncrementalDetokenizer) -> list[int]:
    """Several tokens of one step (accepted proposals, speculative decoding) into the text one at a time: a stop
    string ends the output at the token that completes it, as it would have with a token per step; the step's
    tokens after it are not output. Returns the step's tokens that are."""
    text_ids = ids[:-1] if stopped_by_token else ids  # a stop token is not text
    for i, token in enumerate(text_ids):
        detokenizer.add([token])
        if detokenizer.stopped:
            return ids[: i + 1]
    return ids
