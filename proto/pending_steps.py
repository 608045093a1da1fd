"""The steps a transport sent and not every rank answered: one ledger for both transports (proto/transport.py).

Every rank answers every plan; the output rank's result carries the sampled tokens. A step's future completes
once all answered (with that result), fails at the first StepError (StepFailed), or fails with the error the
transport gives when it loses a rank. Answers to a step no longer pending (dropped with a recovery, already
answered by that rank) are stale and ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from proto.transport import StepFailed
from proto.wire import StepError, StepResult

logger = logging.getLogger(__name__)

Rank = TypeVar("Rank", bound=Hashable)  # how a transport names a rank: its socket identity, its index


@dataclass(slots=True)
class _Step(Generic[Rank]):
    waiting: set[Rank]  # ranks that have not answered yet
    output: Rank  # the rank whose result carries the sampled tokens
    future: asyncio.Future[StepResult]
    result: StepResult | None = None


class PendingSteps(Generic[Rank]):
    def __init__(self) -> None:
        self._steps: dict[int, _Step[Rank]] = {}
        self.most = 0  # steps pending at once, at most (observability: does the engine overlap?)

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step_id: int, ranks: set[Rank], output: Rank) -> asyncio.Future[StepResult]:
        """A step sent to `ranks`: the future of its result."""
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._steps[step_id] = _Step(set(ranks), output, future)
        self.most = max(self.most, len(self._steps))
        return future

    def oldest_owing(self) -> set[Rank] | None:
        """The ranks that owe an answer to the oldest pending step (None: nothing is pending)."""
        return next(iter(self._steps.values())).waiting if self._steps else None

    def answer(self, rank: Rank, msg: StepResult | StepError) -> None:
        step = self._steps.get(msg.step_id)
        if step is None or rank not in step.waiting:
            logger.debug("dropped a stale answer to step %d", msg.step_id)
            return
        if step.future.done():  # the engine dropped the plans in flight (a failed step, a recovery)
            del self._steps[msg.step_id]
            return
        if isinstance(msg, StepError):
            del self._steps[msg.step_id]
            reason = f"rank {msg.rank} could not run step {msg.step_id}: {msg.reason}"
            step.future.set_exception(StepFailed(reason, tuple(msg.handles), tuple(msg.adapters)))
            return
        if rank == step.output:
            step.result = msg
        step.waiting.discard(rank)
        if not step.waiting:
            del self._steps[msg.step_id]
            assert step.result is not None
            step.future.set_result(step.result)

    def fail_all(self, error: BaseException) -> None:
        """A rank was lost: every pending step fails with `error`."""
        for step in self._steps.values():
            if not step.future.done():  # the engine may have cancelled it already (a failed step before)
                step.future.set_exception(error)
        self._steps.clear()

    def cancel_all(self) -> None:
        for step in self._steps.values():
            step.future.cancel()
        self._steps.clear()
