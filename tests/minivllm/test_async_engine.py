"""AsyncLLMEngine: the article's lines as written (a tiny model; once with the default model and flags), cumulative
outputs equal to LLM's, many coroutines batched into the same steps, abort and an abandoned loop end the request,
bad input named, shutdown ends a running stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from minivllm import AsyncEngineArgs, RequestOutput, SamplingParams
from minivllm.async_engine import AsyncLLMEngine
from tests.support.waiting import wait_for

pytestmark = pytest.mark.model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def article_args(folder: Path) -> AsyncEngineArgs:
    """The article's arguments; the tiny model, and a small KV cache to start fast."""
    return AsyncEngineArgs(
        model=str(folder), scheduler_delay=0.05, max_batch_size=32, enable_preemption=True, num_kv_blocks=64
    )


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncLLMEngine]:
    with AsyncLLMEngine.from_engine_args(article_args(tiny_llama_dir)) as engine:
        yield engine


async def collect(engine: AsyncLLMEngine, prompt: object, params: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]  # type: ignore[arg-type]


def test_outputs_are_cumulative_and_equal_llms(engine: AsyncLLMEngine) -> None:
    prompt = [11, 12, 13, 14, 15] * 4
    outputs = asyncio.run(collect(engine, prompt, GREEDY, "cumulative"))
    assert engine.engine.scheduler.config.max_num_seqs == 32  # max_batch_size reached the scheduler
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert all(a == b[: len(a)] and len(a) < len(b) for a, b in zip(tokens, tokens[1:])), "each output extends"
    (expected,) = engine.llm.generate([prompt], GREEDY, use_tqdm=False)
    last = outputs[-1].outputs[0]
    assert last.token_ids == expected.outputs[0].token_ids and last.text == expected.outputs[0].text
    assert last.finish_reason == "length" and outputs[-1].request_id == "cumulative"


def test_many_coroutines_batch_into_the_same_steps(engine: AsyncLLMEngine) -> None:
    before = engine.engine.scheduler.counters.steps

    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine, [20 + i, 21, 22], GREEDY, f"many-{i}") for i in range(8)))

    results = asyncio.run(run())
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 8 for r in results)
    steps = engine.engine.scheduler.counters.steps - before
    assert steps <= 2 * MAX_TOKENS, f"8 requests of 8 tokens took {steps} steps: not batched (one by one: 64)"


def test_abort_ends_the_stream(engine: AsyncLLMEngine) -> None:
    async def run() -> list[RequestOutput]:
        outputs = []
        async for out in engine.generate("Once upon a time", SamplingParams(max_tokens=500, ignore_eos=True), "ab"):
            outputs.append(out)
            if len(outputs) == 1:
                await engine.abort("ab")
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 500
    assert not engine.on_engine(lambda e: e.is_live("ab")).result(10)


def test_leaving_the_loop_aborts_the_request(engine: AsyncLLMEngine) -> None:
    async def run() -> None:
        stream = engine.generate("Once upon a time", SamplingParams(max_tokens=500, ignore_eos=True), "left")
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(run())
    wait_for(lambda: not engine.on_engine(lambda e: e.is_live("left")).result(10), 30, "the left request aborted")


def test_bad_input_is_named(engine: AsyncLLMEngine) -> None:
    async def twice() -> None:
        first = engine.generate([1, 2, 3], SamplingParams(max_tokens=300, ignore_eos=True), "same")
        await first.__anext__()  # type: ignore[attr-defined]
        try:
            with pytest.raises(ValueError, match="request_id: 'same' is already running"):
                await collect(engine, [4, 5], GREEDY, "same")
        finally:
            await first.aclose()  # type: ignore[attr-defined]

    asyncio.run(twice())
    with pytest.raises(ValueError, match="^prompt"):
        asyncio.run(collect(engine, 3.5, GREEDY, "bad"))
    with pytest.raises(TypeError, match="bogus"):
        AsyncLLMEngine(bogus=1)


def test_shutdown_ends_a_running_stream(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(
        str(tiny_llama_dir), num_kv_blocks=64, scheduling_policy="priority", enable_preemption=False
    )
    assert engine.engine.scheduler.policy.preemption_margin == 0  # never displaced by priority

    async def run() -> None:
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in engine.generate("Once", SamplingParams(max_tokens=1000, ignore_eos=True), "late"):
                await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    asyncio.run(run())
    engine.shutdown()  # idempotent


@pytest.mark.slow
def test_the_article_lines_with_the_default_model_and_flags() -> None:
    engine_args = AsyncEngineArgs(scheduler_delay=0.05, max_batch_size=32, enable_preemption=True)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        outputs = asyncio.run(collect(engine, "The capital of France is", SamplingParams(max_tokens=8), "default"))
    finally:
        engine.shutdown()
    assert outputs[-1].finished and outputs[-1].outputs[0].text.strip()
