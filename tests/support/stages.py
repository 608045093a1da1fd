"""Pipeline stages in one process, for tests: each stage a runner, hidden states handed on through HandOffs."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import torch

from proto.parallel import ParallelLayout
from proto.wire import ExecutionMode
from tests.support.engine import load_runner
from worker_node.model_runner import ModelRunner
from worker_node.runtime.parallel import Comm, ParallelRank


class HandOff:
    """Hidden states from one stage to the next. Like gloo's send, `send` returns once the receiver took them.

    `hold`: the receiver, once it took the first states, goes on only after the sender reached its send this
    many times: a pipeline whose first stage runs ahead (plan N+1 while the next stage is still on plan N)
    passes; stages in lock-step, or a scheduler that leaves the next plan empty, time out."""

    def __init__(self, hold: int = 0, timeout: float = 30.0) -> None:
        self.hold = hold
        self.timeout = timeout
        self._states: queue.Queue[torch.Tensor] = queue.Queue()
        self._sends = 0
        self._sent = threading.Condition()

    def send(self, x: torch.Tensor) -> None:
        with self._sent:
            self._sends += 1
            self._sent.notify_all()
        self._states.put(x.clone())
        self._states.join()

    def recv(self) -> torch.Tensor:
        x = self._states.get(timeout=self.timeout)
        self._states.task_done()
        with self._sent:
            if not self._sent.wait_for(lambda: self._sends >= self.hold, self.timeout):
                raise TimeoutError(f"the previous stage did not run ahead to its send {self.hold}")
            self.hold = 0
        return x


class StageComm(Comm):
    """One in-process stage of a TP 1 pipeline: hidden states through HandOffs, no collective across stages."""

    def __init__(self, where: ParallelRank, previous: HandOff | None, following: HandOff | None) -> None:
        super().__init__(where)
        self.previous = previous
        self.following = following

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        assert self.following is not None
        self.following.send(x)

    def recv_from_previous_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.previous is not None
        x = self.previous.recv()
        assert x.shape == shape and x.dtype == dtype, (x.shape, shape)
        return x

    def share_sampled(self, tokens: list[int], count: int) -> list[int]:
        raise AssertionError("with several stages the sampled tokens travel in the next plan, not a broadcast")


def stage_runners(
    folder: Path, num_blocks: int, block_size: int, stages: int = 2, hold: int = 0, **worker: Any
) -> list[ModelRunner]:
    """P stage runners of one pipeline; `hold` goes to the first hand-off (see HandOff); `worker`: more
    WorkerOptions for every stage (offload tiers)."""
    layout = ParallelLayout(1, stages)
    mode = ExecutionMode.for_world(1, stages, async_scheduling=True)
    hand_offs = [HandOff(hold if s == 0 else 0) for s in range(stages - 1)]
    runners = []
    for s in range(stages):
        where = ParallelRank(layout, s)
        comm = StageComm(where, hand_offs[s - 1] if s else None, hand_offs[s] if s < stages - 1 else None)
        runners.append(load_runner(folder, num_blocks, block_size, mode=mode, where=where, comm=comm, **worker))
    return runners
