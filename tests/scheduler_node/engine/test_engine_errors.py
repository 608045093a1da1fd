"""How the engine ends requests, as the doors receive it: a FinishReason on the last delta, and with ERROR an
EngineError carrying the status each door maps (stand-in workers: the engine loop runs for real, no model)."""

from __future__ import annotations

import asyncio

import pytest

from proto.wire import ExecutionMode, SamplingOptions
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import make_policy
from scheduler_node.core.request import FinishReason, RequestSpec
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.model_path import resolve_model
from scheduler_node.engine.outputs import Delta, EngineError, ErrorStatus
from scheduler_node.engine.stand_in import StandInWorkers
from scheduler_node.text.tokenizer import ModelTokenizer

pytestmark = pytest.mark.unit

TOKEN = 7  # what the stand-in workers sample


def engine() -> EngineCore:
    config = SchedulerConfig(block_size=16, max_num_batched_tokens=256, max_num_seqs=4, max_model_len=64)
    scheduler = Scheduler(config, 64, make_policy("fcfs"), ExecutionMode.for_world(1, 1, async_scheduling=True))
    return EngineCore(scheduler, ModelTokenizer(resolve_model("default")), StandInWorkers(64, token=TOKEN))


def spec(max_tokens: int, stop_token_ids: list[int] | None = None, min_tokens: int = 0) -> RequestSpec:
    sampling = SamplingOptions(temperature=0.0, min_tokens=min_tokens)
    return RequestSpec("r", list(range(100, 120)), sampling, max_tokens, [], True, 1, 50,
                       stop_token_ids=stop_token_ids or [])  # fmt: skip


def last_delta(core: EngineCore, request: RequestSpec, act: str = "", deadline_s: float = 0.0) -> list[Delta]:
    async def scenario() -> list[Delta]:
        loop = asyncio.ensure_future(core.run())
        try:
            stream = core.submit(request, deadline_s)
            if act == "end_all":
                core.end_all("the server is shutting down", ErrorStatus.UNAVAILABLE)
            if act == "abort":
                core.abort(request.request_id)
            return [d async for d in stream]
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)

    return asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize(
    ("request_", "reason", "tokens"),
    [
        (spec(5), FinishReason.LENGTH, 5),
        (spec(64 - 20), FinishReason.LENGTH, 64 - 20),  # the output fills max_model_len to the last token
        (spec(9, stop_token_ids=[TOKEN]), FinishReason.STOP, 1),
        (spec(9, stop_token_ids=[TOKEN], min_tokens=3), FinishReason.STOP, 4),  # a stop token past min_tokens
    ],
)
def test_a_sequence_ends_by_its_tokens(request_: RequestSpec, reason: FinishReason, tokens: int) -> None:
    deltas = last_delta(engine(), request_)
    assert deltas[-1].finish_reason is reason and deltas[-1].error is None
    assert sum(len(d.token_ids) for d in deltas) == tokens == deltas[-1].completion_tokens
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_a_request_past_max_model_len_ends_with_a_status_not_a_wait() -> None:
    """Validation refuses prompt + max_tokens over max_model_len; one that gets past it (the cache shrank since)
    ends at once with UNAVAILABLE saying why, never waits for room that will not come."""
    ended = last_delta(engine(), spec(50))[-1]
    assert ended.finish_reason is FinishReason.ERROR and ended.error is not None
    assert ended.error.status is ErrorStatus.UNAVAILABLE and "exceeds max_model_len (64)" in ended.error.message


def test_an_aborted_request_ends_with_abort() -> None:
    deltas = last_delta(engine(), spec(40), act="abort")
    assert deltas[-1].finish_reason is FinishReason.ABORT and deltas[-1].error is None


def test_failures_carry_their_status() -> None:
    ended = last_delta(engine(), spec(40), act="end_all")[-1]
    assert ended.finish_reason is FinishReason.ERROR
    assert ended.error == EngineError(ErrorStatus.UNAVAILABLE, "the server is shutting down")
    # a deadline too short for 40 steps of the event loop
    late = last_delta(engine(), spec(40), deadline_s=1e-6)[-1]
    assert late.finish_reason is FinishReason.ERROR and late.error is not None
    assert late.error.status is ErrorStatus.DEADLINE_EXCEEDED and "deadline_s" in late.error.message
