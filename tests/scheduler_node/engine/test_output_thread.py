"""The output path on its own thread (engine/output_thread.py, engine/output_side.py): what a door sees is what it
saw when the engine's loop detokenized inline, a stop string still frees the sequence's blocks, and the loop gets
one call per batch, whatever the number of streams."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from scheduler_node.core.request import FinishReason, Request, Status, StopConditions
from scheduler_node.core.scheduler import RequestOutput
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.output_side import OutputSide
from scheduler_node.engine.output_thread import Added, Delivery, Ending, OutputProcessor, SequenceOutput
from scheduler_node.engine.outputs import Delta
from scheduler_node.engine.stand_in import StandInWorkers
from scheduler_node.text.detokenizer import IncrementalDetokenizer
from tests.support.stand_in import BLOCK, collect, running, spec, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit

CAT = 2644  # " cat" in the default model's vocabulary


def cat_engine(threaded: bool, num_blocks: int = 64, step_seconds: float = 0.0) -> EngineCore:
    workers = StandInWorkers(num_blocks, token=CAT, block_size=BLOCK, step_seconds=step_seconds)
    return stand_in_engine(EngineOptions(output_thread=threaded), workers=workers, num_blocks=num_blocks)


def test_stop_strings_end_sequences_as_they_did_inline_and_free_their_blocks() -> None:
    """Two requests of two sequences each, one with a stop string its third token completes: the same deltas with
    the output path on its thread as inline, the stopped one cut before the stop string, every block back."""

    async def scenario(threaded: bool) -> list[list[Delta]]:
        # Steps that take a millisecond, as a fast device's do: the loop waits for each, so the output thread gets the
        # GIL. The engine goes on while the thread finds the stop string; 1,000 tokens are long enough that it learns
        # of it long before the length would end the sequence.
        engine = cat_engine(threaded, num_blocks=256, step_seconds=0.001)
        stopping = dataclasses.replace(spec("s", 20, 1000, n=2), prompt_token_ids=[CAT] * 20, stop=["cat cat cat"])
        finishes: list[Status] = []
        finish = engine.scheduler.finish

        def recording(req_id: str, status: Status) -> Request | None:
            finishes.append(status)
            return finish(req_id, status)

        engine.scheduler.finish = recording  # type: ignore[method-assign]
        async with running(engine):
            streams = [engine.submit(stopping), engine.submit(spec("l", 20, 6, n=2))]
            deltas = list(await asyncio.gather(*(collect(s) for s in streams)))
            await asyncio.wait_for(engine.wait_idle(), 30)
        assert engine.num_live == 0 and not engine.outputs.request_of
        assert engine.scheduler.num_unfinished == 0
        assert engine.scheduler.blocks.num_free == 256, "the stopped sequences' blocks are back too"
        assert finishes.count(Status.FINISHED_STOPPED) == 2, "the scheduler learnt of both stop strings"
        return deltas

    inline, threaded = asyncio.run(scenario(False)), asyncio.run(scenario(True))
    assert threaded == inline
    stopped, lengthy = threaded
    for index in (0, 1):
        text = "".join(d.text for d in stopped if d.index == index)
        (last,) = [d for d in stopped if d.index == index and d.finish_reason]
        assert (text, last.finish_reason, last.completion_tokens) == (" ", FinishReason.STOP, 3)  # " cat cat cat"
        (last,) = [d for d in lengthy if d.index == index and d.finish_reason]
        assert (last.finish_reason, last.completion_tokens) == (FinishReason.LENGTH, 6)


class Sink:
    """A threadsafe sink: records each delta and the thread that put it."""

    threadsafe = True
    incremental = True

    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.threads: set[int] = set()

    def put(self, delta: Delta) -> None:
        self.deltas.append(delta)
        self.threads.add(threading.get_ident())


def test_a_threadsafe_sink_gets_its_deltas_on_the_output_thread_and_the_loop_no_call() -> None:
    async def scenario() -> None:
        engine = cat_engine(threaded=True)
        sink, calls = Sink(), []
        deliver = engine.outputs._deliver

        def recording(delivery: Delivery) -> None:
            calls.append(delivery)
            deliver(delivery)

        engine.outputs._deliver = recording  # type: ignore[method-assign]
        async with running(engine):
            engine.submit_to(spec("t", 20, 5), sink)
            await asyncio.wait_for(engine.wait_idle(), 30)
        assert [t for d in sink.deltas for t in d.token_ids] == [CAT] * 5
        assert sink.deltas[-1].finish_reason == FinishReason.LENGTH
        assert threading.get_ident() not in sink.threads, "put on the output thread, not the loop's"
        assert all(not d.deltas for d in calls), "the loop only hears that the sequence ended"

    asyncio.run(scenario())


def test_one_step_of_many_streams_is_one_delivery() -> None:
    processor = OutputProcessor(Metrics("test"))
    stop = StopConditions(max_tokens=8)
    sinks = []
    requests = []
    for i in range(5):
        sink = Sink()
        sink.threadsafe = False  # read on the loop: the delivery carries it
        detokenizer = IncrementalDetokenizer(tokenizer(), [100, 101], [], stop.may_stop)
        processor.process([Added(f"r{i}", SequenceOutput(sink, 0, detokenizer, 2, 0.0, False))])
        sinks.append(sink)
        requests.append(Request(f"r{i}", [100, 101], spec("x", 2, 8).sampling, stop))
    delivery = processor.process([[RequestOutput(req, [CAT]) for req in requests]])
    assert isinstance(delivery, Delivery)
    assert [sink for sink, _ in delivery.deltas] == sinks
    assert all(delta.token_ids == [CAT] for _, delta in delivery.deltas)
    assert not delivery.stopped and not delivery.ended


def test_an_output_side_without_a_thread_delivers_at_once() -> None:
    """Tests that drive no engine loop (and the engine after its loop ended) process inline."""

    async def scenario() -> None:
        side = OutputSide(tokenizer(), Metrics("test"), on_stop=lambda req_id: None)
        sink = Sink()
        sink.threadsafe = False
        request = dataclasses.replace(spec("a", 2, 4))
        seq = Request("a#0", request.prompt_token_ids, request.sampling, StopConditions(4))
        side.add(request, [seq], sink)
        assert not side.idle.is_set()
        seq.status = seq.status.FINISHED_ABORTED
        side.end(seq)
        assert [d.finish_reason for d in sink.deltas] == [FinishReason.ABORT]
        assert side.idle.is_set() and not side.requests

    asyncio.run(scenario())


class WholeSink(Sink):
    """A sink that reads its output whole (as LLM's collectors do)."""

    incremental = False


# "Hé said 😀 café 你好 ok": characters split over several tokens (the emoji, the CJK pair) among whole ones
MIXED = [56, 2756, 1137, 40303, 218, 37366, 216, 18645, 250, 48392, 138, 10907]
EOS = 2


def _follow(processor: OutputProcessor, req_id: str, sink: Sink, stop: list[str]) -> Request:
    conditions = StopConditions(max_tokens=64)
    detokenizer = IncrementalDetokenizer(tokenizer(), [100, 101], stop, conditions.may_stop)
    sequence = SequenceOutput(sink, 0, detokenizer, 2, 0.0, False)
    if not (sink.incremental or stop):
        sequence.held = []  # as OutputSide.add makes it for such a sink
    processor.process([Added(req_id, sequence)])
    return Request(req_id, [100, 101], spec("x", 2, 64).sampling, conditions)


def test_a_sink_read_whole_gets_the_text_a_stream_gets_in_one_delta() -> None:
    """Tokens one a step, the last a stop token: the joined text and tokens of a stream and of a sink that reads
    its output whole are the same, and the whole one gets one delta (nothing per step); an abort mid-way brings
    it what it had too."""
    processor = OutputProcessor(Metrics("test"))
    stream, whole, aborted = Sink(), WholeSink(), WholeSink()
    reqs = [_follow(processor, rid, sink, []) for rid, sink in (("s", stream), ("w", whole), ("a", aborted))]
    for token in MIXED:
        processor.process([[RequestOutput(req, [token]) for req in reqs]])
        if token == MIXED[5]:  # mid-way, after "Hé said 😀 café": the engine aborts the third
            processor.process([Ending("a", FinishReason.ABORT, 6)])
            reqs.pop()
    end = dict(finish_reason=FinishReason.STOP, stopped_by_token=True, num_output_tokens=13)
    processor.process([[RequestOutput(req, [EOS], **end) for req in reqs]])  # type: ignore[arg-type]
    text = "Hé said 😀 café 你好 ok"
    assert "".join(d.text for d in stream.deltas) == text and len(stream.deltas) > 1
    assert [t for d in stream.deltas for t in d.token_ids] == MIXED + [EOS]
    (delta,) = whole.deltas
    assert (delta.text, delta.token_ids, delta.finish_reason) == (text, MIXED + [EOS], FinishReason.STOP)
    (delta,) = aborted.deltas
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("Hé said 😀 café", MIXED[:6], FinishReason.ABORT)
    assert processor.metrics.generation_tokens._value.get() == 2 * 13 + 6  # counted per step all the same


def test_a_sink_read_whole_with_a_stop_string_is_followed_per_step() -> None:
    """A stop string is looked for at every token, whatever the sink: the output is cut there and the engine told."""
    processor = OutputProcessor(Metrics("test"))
    whole = WholeSink()
    req = _follow(processor, "w", whole, ["café"])
    stopped = []
    for token in MIXED:
        stopped += processor.process([[RequestOutput(req, [token])]]).stopped
    assert stopped == ["w"]
    assert "".join(d.text for d in whole.deltas) == "Hé said 😀 "
    assert whole.deltas[-1].finish_reason == FinishReason.STOP
