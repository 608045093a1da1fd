"""The pending-steps ledger both transports share (proto/pending_steps.py): a step's result once every rank
answered (the output rank's), StepFailed at a StepError, stale answers ignored, every step failed at a loss."""

from __future__ import annotations

import asyncio

import pytest

from proto.pending_steps import PendingSteps
from proto.transport import StepFailed, WorkerLost
from proto.wire import StepError, StepResult

pytestmark = pytest.mark.unit


def test_a_step_completes_with_the_output_ranks_result_once_every_rank_answered() -> None:
    async def scenario() -> None:
        steps: PendingSteps[int] = PendingSteps()
        future = steps.add(7, {0, 1}, output=1)
        steps.answer(1, StepResult(7, sampled={3: [42]}))
        assert not future.done(), "rank 0 still owes its answer"
        assert steps.oldest_owing() == {0}
        steps.answer(1, StepResult(7, {}))  # a second answer of the same rank: stale
        steps.answer(0, StepResult(7, {}))
        assert future.result().sampled == {3: [42]}
        assert len(steps) == 0 and steps.most == 1
        steps.answer(0, StepResult(7, {}))  # after the step completed: stale, ignored

    asyncio.run(scenario())


def test_a_step_error_fails_the_step_and_a_loss_fails_every_step() -> None:
    async def scenario() -> None:
        steps: PendingSteps[str] = PendingSteps()
        failed, first, second = steps.add(1, {"a"}, "a"), steps.add(2, {"a"}, "a"), steps.add(3, {"a"}, "a")
        steps.answer("a", StepError(1, 0, "out of memory"))
        with pytest.raises(StepFailed, match="rank 0 could not run step 1: out of memory"):
            failed.result()
        first.cancel()  # the engine dropped it: its answer only clears it
        steps.answer("a", StepResult(2, {}))
        assert steps.oldest_owing() == {"a"} and len(steps) == 1
        steps.fail_all(WorkerLost("gone"))
        with pytest.raises(WorkerLost):
            second.result()
        assert steps.oldest_owing() is None

    asyncio.run(scenario())
