"""Admission never promises what the KV cache cannot deliver (issue 25, defect 1): a request that fits the cache
starts, however large, while the engine keeps serving; `max_model_len` follows the cache the world has now (a
ResizeCache, a smaller replacement worker); a shrink that would strand a live request is refused, or ends it with
a clear status. The real engine over stand-in workers (tests/support/stand_in.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from proto import serving_pb2 as pb
from proto.wire import ExecutionMode
from scheduler_node.api.validation import InvalidField, validate
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.engine.builder import resolve_max_model_len
from scheduler_node.engine.outputs import ErrorStatus
from tests.support.stand_in import StandInRun, spec, tokenizer

pytestmark = pytest.mark.unit

BLOCK = 16
ISSUE_BLOCKS = 113  # vllm-serve --kv-cache-memory 40MiB on the default model


def _issue_config(budget: int = 2048) -> SchedulerConfig:
    """vllm-serve's defaults (watermark 0.01, step budget 2048) over 113 blocks: max_model_len capped to 1,808."""
    max_len = resolve_max_model_len(0, 8192, ISSUE_BLOCKS, BLOCK)
    assert max_len == 1808
    return SchedulerConfig(block_size=BLOCK, max_model_len=max_len, max_num_batched_tokens=budget)


def _drive(run: StandInRun, scenario: Callable[[StandInRun], Awaitable[None]]) -> None:
    async def main() -> None:
        run.start()
        try:
            await scenario(run)
        finally:
            await run.stop()

    asyncio.run(main())


def test_a_prompt_that_fills_the_whole_cache_starts_and_the_engine_keeps_serving() -> None:
    """The issue's case: 1,800 prompt tokens take all 113 blocks. Admission added the watermark (1 block) to them,
    so it never started; the engine failed ("waiting requests fit in no KV configuration") and refused everything
    after. With nothing else running, the watermark protects no one and is not asked for."""
    run = StandInRun.build(_issue_config(), ISSUE_BLOCKS)

    async def scenario(run: StandInRun) -> None:
        run.submit(spec("long", 1800, 1))
        await run.until_idle()
        run.submit(spec("next", 20, 5))
        await run.until_idle()

    _drive(run, scenario)
    assert [(d.finish_reason, d.completion_tokens) for d in run.ends("long")] == [("length", 1)]
    assert [(d.finish_reason, d.completion_tokens) for d in run.ends("next")] == [("length", 5)]
    run.assert_idle()


def test_a_prompt_larger_than_the_step_budget_that_fills_the_cache_starts_in_chunks() -> None:
    run = StandInRun.build(_issue_config(budget=256), ISSUE_BLOCKS)

    async def scenario(run: StandInRun) -> None:
        run.submit(spec("long", 1790, 18))  # 1,807 tokens of KV: every block
        await run.until_idle()

    _drive(run, scenario)
    assert [(d.finish_reason, d.completion_tokens) for d in run.ends("long")] == [("length", 18)]
    assert run.workers.plans >= 1790 // 256 + 17, "the prompt ran in chunks of the step budget"
    run.assert_idle()


def test_forks_that_share_the_only_block_take_turns() -> None:
    """n = 3 on a one-block cache: the parent cannot grow (its forks share its block), preempts itself, and the
    step started nothing while nothing ran; the engine failed. Now the forks let go in turn and all finish."""
    config = SchedulerConfig(block_size=8, max_num_batched_tokens=3, max_num_seqs=1, max_model_len=8, watermark=0.0)
    run = StandInRun.build(config, 1, mode=ExecutionMode.for_world(1, 1, async_scheduling=False))

    async def scenario(run: StandInRun) -> None:
        run.submit(spec("forks", 1, 7, n=3))
        await run.until_idle()

    _drive(run, scenario)
    assert sorted((d.index, d.finish_reason, d.completion_tokens) for d in run.ends("forks")) == [
        (0, "length", 7),
        (1, "length", 7),
        (2, "length", 7),
    ]
    run.assert_idle()


def test_max_model_len_follows_a_resize_and_validation_names_it() -> None:
    run = StandInRun.build(_issue_config(), ISSUE_BLOCKS)
    engine = run.engine
    engine.resize_cache(50)
    assert engine.max_model_len == 800
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[100] * 900))
    with pytest.raises(InvalidField, match="max_model_len is 800") as err:
        validate(request, tokenizer(), engine.max_model_len)
    assert err.value.field == "prompt_token_ids"
    sampling = pb.SamplingParams(max_tokens=200)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[100] * 700), sampling=sampling)
    with pytest.raises(InvalidField, match=r"exceeds max_model_len \(800\)") as err:
        validate(request, tokenizer(), engine.max_model_len)
    assert err.value.field == "sampling.max_tokens"
    engine.resize_cache(ISSUE_BLOCKS)
    assert engine.max_model_len == 1808


def test_a_shrink_that_would_strand_a_live_request_is_refused() -> None:
    """ResizeCache(1) used to pause every stream until the size was restored: the live request may grow to 1,000
    tokens, more than one block holds. The shrink is refused with why; the request finishes."""
    run = StandInRun.build(_issue_config(), ISSUE_BLOCKS)

    async def scenario(run: StandInRun) -> None:
        run.submit(spec("live", 10, 990))
        with pytest.raises(MemoryError, match=r"may grow to 1000 tokens .* more than 1 block\(s\) hold \(16 tokens\)"):
            run.engine.resize_cache(1)
        assert run.engine.max_model_len == 1808
        await run.until_idle()

    _drive(run, scenario)
    assert [(d.finish_reason, d.completion_tokens) for d in run.ends("live")] == [("length", 990)]
    assert run.engine.scheduler.blocks.usable_blocks == ISSUE_BLOCKS
    run.engine.resize_cache(1)  # at idle nothing is stranded
    assert run.engine.max_model_len == BLOCK


def test_a_smaller_replacement_ends_what_it_cannot_hold_and_serves_the_rest() -> None:
    """A replacement worker holds 20 blocks (320 tokens): the request that may grow to 1,000 tokens ends with
    UNAVAILABLE and why (it waited forever); the short one finishes; max_model_len and the ResizeCache limit
    follow the smaller world."""
    run = StandInRun.build(_issue_config(), ISSUE_BLOCKS)

    async def scenario(run: StandInRun) -> None:
        run.submit(spec("long", 10, 990))
        run.submit(spec("short", 10, 100))
        for _ in range(20):
            await asyncio.sleep(0)  # a few steps in
        run.workers.replace_rank(20)
        await run.until_idle()

    _drive(run, scenario)
    [long] = run.ends("long")
    assert long.finish_reason == "error" and long.error is not None
    assert long.error.status is ErrorStatus.UNAVAILABLE
    assert "shrank to 320 tokens" in long.error.message and "needs up to 1000" in long.error.message
    assert [(d.finish_reason, d.completion_tokens) for d in run.ends("short")] == [("length", 100)]
    assert run.engine.max_model_len == 320
    assert run.engine.max_kv_blocks == 20
    with pytest.raises(ValueError, match=r"num_blocks: must be in \[1, 20\]"):
        run.engine.resize_cache(ISSUE_BLOCKS)  # blocks 20 and up are not on the replacement
    run.assert_idle()


def test_a_request_validated_before_a_shrink_ends_at_once_with_why() -> None:
    """Validation runs off the event loop: the cache may shrink before the request is submitted."""
    run = StandInRun.build(_issue_config(), ISSUE_BLOCKS)

    async def scenario(run: StandInRun) -> None:
        run.engine.resize_cache(10)
        run.submit(spec("late", 150, 20, n=2))
        await run.until_idle()

    _drive(run, scenario)
    ends = run.ends("late")
    assert [(d.index, d.finish_reason) for d in ends] == [(0, "error"), (1, "error")]
    for d in ends:
        assert d.error is not None and d.error.status is ErrorStatus.UNAVAILABLE
        assert "exceeds max_model_len (160)" in d.error.message
    run.assert_idle()


def test_a_request_the_scheduler_cannot_start_fails_alone() -> None:
    """Should admission ever let through a request the scheduler cannot start, that request fails (INTERNAL) and
    the engine serves the next one: it used to stop, and refuse every later request."""
    run = StandInRun.build(_issue_config(), ISSUE_BLOCKS)
    scheduler = run.engine.scheduler
    claim = scheduler.claims.claim
    scheduler.claims.claim = lambda req, budget: not req.req_id.startswith("bad") and claim(req, budget)  # type: ignore[method-assign]

    async def scenario(run: StandInRun) -> None:
        run.submit(spec("bad", 10, 5))
        await run.until_idle()
        run.submit(spec("good", 10, 5))
        await run.until_idle()

    _drive(run, scenario)
    [bad] = run.ends("bad")
    assert bad.finish_reason == "error" and bad.error is not None
    assert bad.error.status is ErrorStatus.INTERNAL and "could not start" in bad.error.message
    assert [(d.finish_reason, d.completion_tokens) for d in run.ends("good")] == [("length", 5)]
    run.assert_idle()
