"""The engine core over stand-in workers: what a door sees (streams, usage, abort, deadlines, the queue bound,
draining) and how the loop lives through failures (a failed step, a lost rank that rejoins or does not, a step past
its deadline, the loop itself failing). The scheduler and the loop are real; only the forward pass is free."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from proto.wire import StepPlan, StepResult
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.core.request import FinishReason
from scheduler_node.engine.options import EngineOptions
from scheduler_node.engine.outputs import Delta, ErrorStatus
from scheduler_node.engine.stand_in import StandInWorkers
from tests.support.stand_in import TOKEN, ControlledWorkers, collect, running, spec, stand_in_engine
from tests.support.waiting import until

pytestmark = pytest.mark.unit


def tokens_of(deltas: list[Delta], index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.token_ids]


def ending(deltas: list[Delta], index: int = 0) -> Delta:
    (last,) = [d for d in deltas if d.index == index and d.finish_reason]
    return last


def failure(last: Delta) -> tuple[ErrorStatus, str]:
    """How the engine failed the sequence whose last delta this is."""
    assert last.finish_reason == FinishReason.ERROR and last.error is not None, last
    return last.error.status, last.error.message


def test_a_request_streams_its_tokens_and_ends_with_its_usage() -> None:
    async def scenario() -> None:
        engine = stand_in_engine()
        async with running(engine):
            deltas = await collect(engine.submit(spec("a", 20, 5)))
        assert tokens_of(deltas) == [TOKEN] * 5
        last = ending(deltas)
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 20, 5)
        assert "".join(d.text for d in deltas) == engine.tokenizer.decode([TOKEN] * 5)
        assert not engine.is_live("a") and engine.num_live == 0
        assert engine.scheduler.blocks.num_free == 64, "every block back"
        assert engine.metrics.generation_tokens._value.get() == 5  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_every_one_of_n_sequences_streams_to_its_end() -> None:
    async def scenario() -> list[Delta]:
        engine = stand_in_engine()
        async with running(engine):
            return await collect(engine.submit(spec("n", 20, 3, n=3)))

    deltas = asyncio.run(scenario())
    for index in range(3):
        assert tokens_of(deltas, index) == [TOKEN] * 3
        assert ending(deltas, index).finish_reason == "length"


def test_a_request_id_in_use_is_refused() -> None:
    async def scenario() -> None:
        engine = stand_in_engine(workers=ControlledWorkers(hold=True))
        async with running(engine):
            engine.submit(spec("same", 20, 4))
            with pytest.raises(KeyError):
                engine.submit(spec("same", 20, 4))

    asyncio.run(scenario())


def test_abort_ends_every_sequence_and_frees_its_blocks() -> None:
    async def scenario() -> None:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(workers=workers)
        async with running(engine):
            stream = engine.submit(spec("x", 20, 50, n=2))
            await workers.until_sent()
            assert engine.abort("x") and not engine.abort("x") and not engine.abort("never")
            deltas = await collect(stream)
        assert {(d.index, d.finish_reason) for d in deltas} == {(0, "abort"), (1, "abort")}
        assert engine.scheduler.blocks.num_free == 64 and engine.num_live == 0

    asyncio.run(scenario())


def test_a_request_past_its_deadline_ends_with_deadline_exceeded() -> None:
    async def scenario() -> None:
        engine = stand_in_engine(workers=ControlledWorkers(hold=True))  # the step never ends on its own
        async with running(engine):
            deltas = await asyncio.wait_for(collect(engine.submit(spec("d", 20, 50), deadline_s=0.05)), 10)
        last = ending(deltas)
        assert failure(last) == (ErrorStatus.DEADLINE_EXCEEDED, "deadline_s: 0.05 s passed before the request finished")
        assert engine.num_live == 0 and engine.scheduler.blocks.num_free == 64

    asyncio.run(scenario())


def test_a_deadline_that_is_met_changes_nothing_and_its_timer_goes() -> None:
    async def scenario() -> None:
        engine = stand_in_engine()
        async with running(engine):
            deltas = await collect(engine.submit(spec("e", 20, 4), deadline_s=30))
        assert ending(deltas).finish_reason == "length"
        assert not engine.outputs.deadlines, "the timer of a finished request is cancelled"

    asyncio.run(scenario())


def test_the_waiting_queue_bound() -> None:
    async def scenario() -> None:
        engine = stand_in_engine(EngineOptions(max_waiting_requests=3), workers=ControlledWorkers(hold=True))
        assert not engine.queue_full(3)
        engine.submit(spec("a", 20, 4))  # the loop is not running: they wait
        engine.submit(spec("b", 20, 4, first=1100))
        assert engine.queue_full(2) and not engine.queue_full(1)
        unbounded = stand_in_engine(workers=ControlledWorkers(hold=True))
        for i in range(10):
            unbounded.submit(spec(f"r{i}", 20, 4, first=100 + 1000 * i))
        assert not unbounded.queue_full(100)

    asyncio.run(scenario())


def test_drain_refuses_new_work_and_waits_for_the_live_requests() -> None:
    async def scenario() -> None:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(workers=workers)
        async with running(engine):
            stream = engine.submit(spec("live", 20, 3))
            assert engine.unavailable() == ""
            workers.changed.clear()
            assert await engine.drain(0.05) == 1, "the held request is still live"
            assert "draining" in engine.unavailable() and workers.changed.is_set()
            hurry = asyncio.Event()
            hurry.set()
            assert await engine.drain(None, hurry) == 1, "hurry ends the wait"
            workers.release()
            assert await asyncio.wait_for(engine.drain(None), 10) == 0
            assert ending(await collect(stream)).finish_reason == "length"

    asyncio.run(scenario())


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on() -> None:
    async def scenario() -> None:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(workers=workers)
        async with running(engine):
            stream = engine.submit(spec("doomed", 20, 5))
            await workers.until_sent()
            workers.fail_next = "rank 0 could not run step 1: out of memory"
            workers.release()
            deltas = await collect(stream)
            later = await collect(engine.submit(spec("fine", 20, 4, first=1100)))
        last = ending(deltas)
        status, message = failure(last)
        assert status == ErrorStatus.INTERNAL and "out of memory" in message
        assert ending(later).finish_reason == "length" and tokens_of(later) == [TOKEN] * 4

    asyncio.run(scenario())


def test_a_step_that_fails_for_one_request_fails_it_alone_and_recomputes_the_others() -> None:
    """The worker names the request whose own inputs failed the step (StepError.handles: its adapter could not be
    read, say): that one fails with FAILED_PRECONDITION, the others of the step finish as if nothing happened."""

    async def scenario() -> None:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(workers=workers)
        bad = LoraRef("bad", 7, "/adapters/bad")
        async with running(engine):
            specs = [spec(f"r{i}", 20, 5, first=100 + 1000 * i) for i in range(4)]
            specs[2] = dataclasses.replace(specs[2], lora=bad)
            streams = [engine.submit(s) for s in specs]
            await workers.until_sent()
            culprit = next(r.handle for r in engine.scheduler.requests.values() if r.req_id.startswith("r2"))
            workers.fail_next = "rank 0 could not run step 1: adapter 'bad' cannot be read"
            workers.blame, workers.unusable = (culprit,), (bad.id,)
            workers.release()
            results = [await asyncio.wait_for(collect(s), 10) for s in streams]
            plans = workers.plans
            later = dataclasses.replace(specs[2], request_id="later")
            again = await asyncio.wait_for(collect(engine.submit(later)), 10)
            assert workers.plans == plans, "a request naming an adapter the workers cannot use runs no step"
            status, message = failure(ending(again))
            assert status == ErrorStatus.FAILED_PRECONDITION and "cannot be read" in message
        for i, deltas in enumerate(results):
            if i == 2:
                status, message = failure(ending(deltas))
                assert status == ErrorStatus.FAILED_PRECONDITION and "cannot be read" in message
            else:
                assert ending(deltas).finish_reason == "length" and tokens_of(deltas) == [TOKEN] * 5, i
        assert engine.scheduler.blocks.num_used == 0

    asyncio.run(scenario())


def test_a_step_that_fails_with_nobody_blamed_fails_only_the_request_that_fails_alone() -> None:
    """No worker can say whose fault it was: the step's requests run alone until each has sampled; the one whose
    own step fails again is the culprit (INTERNAL), the others finish untouched (core/quarantine.py)."""

    async def scenario() -> None:
        workers = ControlledWorkers()
        engine = stand_in_engine(workers=workers)
        async with running(engine):
            workers.crash = 1  # the first request of the next plan that computes: every plan with it fails
            streams = [engine.submit(spec(f"r{i}", 20, 5, first=100 + 1000 * i)) for i in range(4)]
            results = [await asyncio.wait_for(collect(s), 10) for s in streams]
        assert workers.crashing, "the fault was injected"
        failed = [i for i, deltas in enumerate(results) if ending(deltas).finish_reason == "error"]
        assert len(failed) == 1
        status, message = failure(ending(results[failed[0]]))
        assert status == ErrorStatus.INTERNAL and "crashed" in message
        for i, deltas in enumerate(results):
            if i not in failed:
                assert ending(deltas).finish_reason == "length" and tokens_of(deltas) == [TOKEN] * 5, i
        assert not engine.scheduler.quarantine.active and engine.scheduler.blocks.num_used == 0

    asyncio.run(scenario())


def test_a_lost_rank_that_rejoins_in_time_resumes_every_request_by_recompute() -> None:
    async def scenario() -> None:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(EngineOptions(rejoin_timeout=30), workers=workers)
        async with running(engine):
            streams = [engine.submit(spec(f"r{i}", 20, 6, first=100 + 1000 * i)) for i in range(3)]
            await workers.until_sent()
            workers.lose()
            losses = engine.metrics.worker_losses._value  # type: ignore[attr-defined]
            await until(lambda: losses.get() == 1, 10, "the engine counts the loss")
            assert engine.unavailable() == "", "within the rejoin timeout requests are still taken"
            workers.rejoin()
            workers.release()
            results = [await asyncio.wait_for(collect(s), 10) for s in streams]
        for deltas in results:
            assert ending(deltas).finish_reason == "length" and tokens_of(deltas) == [TOKEN] * 6

    asyncio.run(scenario())


def test_a_lost_rank_that_does_not_rejoin_fails_the_requests_until_the_world_is_back() -> None:
    async def scenario() -> None:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(EngineOptions(rejoin_timeout=0.05), workers=workers)
        async with running(engine):
            stream = engine.submit(spec("stranded", 20, 6))
            await workers.until_sent()
            workers.lose()
            last = ending(await asyncio.wait_for(collect(stream), 10))
            status, message = failure(last)
            assert status == ErrorStatus.UNAVAILABLE and "no worker rejoined within 0.05 s" in message
            assert "no worker rejoined" in engine.unavailable()
            workers.changed.clear()
            workers.rejoin()
            workers.release()
            await until(lambda: not engine.gave_up, 10, "the engine sees the world back")
            assert engine.unavailable() == "" and workers.changed.is_set()
            again = await asyncio.wait_for(collect(engine.submit(spec("again", 20, 4, first=1100))), 10)
        assert ending(again).finish_reason == "length"

    asyncio.run(scenario())


def test_a_step_past_its_deadline_declares_its_ranks_lost() -> None:
    async def scenario() -> None:
        workers = ControlledWorkers(hold=True)  # a hung step: never answered
        engine = stand_in_engine(EngineOptions(step_timeout=0.05, rejoin_timeout=0.05), workers=workers)
        async with running(engine):
            last = ending(await asyncio.wait_for(collect(engine.submit(spec("hung", 5, 4))), 10))
        (reason,) = workers.declared
        assert reason.startswith("step 1 ran past its") and reason.endswith("deadline"), reason
        assert failure(last)[0] == ErrorStatus.UNAVAILABLE

    asyncio.run(scenario())


class BrokenWorkers(StandInWorkers):
    def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        raise RuntimeError("the transport broke")


def test_a_loop_that_fails_ends_every_request_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        engine = stand_in_engine(workers=BrokenWorkers(64))
        async with running(engine) as loop:
            deltas = await asyncio.wait_for(collect(engine.submit(spec("a", 20, 4))), 10)
            with pytest.raises(RuntimeError, match="the transport broke"):
                await loop
        last = ending(deltas)
        assert failure(last)[0] == ErrorStatus.INTERNAL
        assert engine.failed == "engine failed: the transport broke" == engine.unavailable()
        with pytest.raises(RuntimeError, match="engine failed"):
            engine.submit(spec("b", 20, 4))

    asyncio.run(scenario())


def test_resize_and_live_metrics_read_the_scheduler() -> None:
    async def scenario() -> None:
        engine = stand_in_engine()
        assert engine.max_model_len == 64 * 16 and engine.compact_tokens == 0
        assert engine.resize_cache(32) == 0 and engine.scheduler.blocks.usable_blocks == 32
        assert engine.max_model_len == 32 * 16, "the longest request follows the cache the world has now"
        live = engine.live_metrics()
        assert live["minivllm:workers_ready"] == 1 and live["vllm:num_requests_running"] == 0
        assert not engine.interrupt_in_flight(), "nothing in flight to interrupt"

    asyncio.run(scenario())
