"""The in-process transport (proto/transport.py): the engine core drives workers that live in this process.

Each rank's runner gets its own step thread that runs plans in order, as a worker process does, so plans stay in
flight while the event loop builds the next one. Plans and results still go through the msgpack wire: what runs
here is what runs behind a socket, and neither side can alias the other's objects. Used by the offline API (a
world of one), by tests and by benchmarks; TP/PP worlds of the offline API use worker processes instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from kernels.kv_quant import format_name
from proto.pending_steps import PendingSteps
from proto.transport import WorkerLost, WorldCapacity
from proto.wire import Assignment, Message, StepError, StepPlan, StepResult, WorkerReady, decode, encode
from settings.worker import WorkerOptions
from worker_node.loading import load_rank, pick_device
from worker_node.model_runner import ModelRunner
from worker_node.plan_loop import StepThread
from worker_node.runtime.parallel import SINGLE, Comm

logger = logging.getLogger(__name__)


class InProcessWorkers:
    """Ranks in this process. Built from worker options (it loads the one rank of a world of one when the engine
    starts it), or from runners built elsewhere (tests: pipeline stages wired together in one process)."""

    def __init__(
        self,
        options: WorkerOptions | None = None,
        runners: list[ModelRunner] | None = None,
        output_rank: int = 0,
    ) -> None:
        self.options = options or WorkerOptions()
        self.runners = list(runners or [])
        self.output_rank = output_rank
        self.lost = asyncio.Event()
        self.changed = asyncio.Event()
        self._capacity: WorldCapacity | None = None
        self._threads: list[StepThread] = []
        self._pending: PendingSteps[int] = PendingSteps()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_plan: Callable[[StepPlan], None] | None = None  # sees every plan as the ranks get it (tests)

    # ---- the transport interface

    @property
    def all_ready(self) -> bool:
        return bool(self._threads) and not self.lost.is_set()

    @property
    def lost_reason(self) -> str:
        return "an in-process rank was declared lost" if self.lost.is_set() else ""

    @property
    def num_ready(self) -> int:
        return len(self._threads) if self.all_ready else 0

    @property
    def capacity(self) -> WorldCapacity:
        if self._capacity is None:
            raise RuntimeError("the in-process world has not started")
        return self._capacity

    async def start(self, assignment: Callable[[int], Assignment], timeout: float) -> WorldCapacity:
        self._loop = asyncio.get_running_loop()
        if not self.runners:
            a = assignment(0)
            if a.world_size != 1:
                raise ValueError(f"in-process workers run a world of one; this one has {a.world_size} ranks")
            device = pick_device(a.device or self.options.device)
            runner, ready = await asyncio.to_thread(load_rank, a, self.options, device, Comm(SINGLE))
            self.runners = [runner]
            self._capacity = WorldCapacity.of([ready])
        else:
            self._capacity = _capacity_of(self.runners)
        for rank, runner in enumerate(self.runners):
            overlap = runner if runner.overlap else None
            thread = StepThread(rank, runner.execute, self._deliver_from(rank), self._thread_setup, overlap=overlap)
            thread.start()
            self._threads.append(thread)
        self.changed.set()
        return self._capacity

    def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        if not self.all_ready or self._loop is None:
            raise WorkerLost(self.lost_reason or "the in-process workers are not running")
        data = encode(plan)
        future = self._pending.add(plan.step_id, set(range(len(self._threads))), self.output_rank)
        for thread in self._threads:
            copy = decode(data)  # each rank its own, as each worker decodes its own
            assert isinstance(copy, StepPlan)
            if self.on_plan is not None and thread.rank == self.output_rank:
                self.on_plan(copy)
            thread.inbox.put(copy)
        return future

    def interrupt(self, first_step_id: int, last_step_id: int) -> bool:
        if len(self.runners) != 1 or not self.runners[0].interruptible:
            return False
        self.runners[0].interrupts.add(first_step_id, last_step_id)
        return True

    def declare_lost(self, reason: str) -> None:
        logger.error("in-process workers lost: %s", reason)
        self.lost.set()
        self.changed.set()
        self._pending.fail_all(WorkerLost(reason))

    async def wait_ready(self, timeout: float | None) -> bool:
        return self.all_ready  # nothing rejoins in-process: a lost world stays lost

    async def close(self, reason: str = "closing") -> None:
        for thread in self._threads:
            thread.stop()
        # Polled, not joined in the executor: at interpreter exit (an LLM closed by its atexit hook) the executors
        # already refuse work.
        deadline = time.monotonic() + 5.0
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._pending.cancel_all()
        self._threads.clear()

    # ---- the step threads' side

    def _thread_setup(self) -> None:
        if self.options.threads:
            torch.set_num_threads(self.options.threads)

    def _deliver_from(self, rank: int) -> Callable[[Message], None]:
        def deliver(reply: Message) -> None:
            data = encode(reply)
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._on_reply, rank, data)

        return deliver

    def _on_reply(self, rank: int, data: bytes) -> None:
        reply = decode(data)
        assert isinstance(reply, (StepResult, StepError))
        self._pending.answer(rank, reply)

    @property
    def most_in_flight(self) -> int:
        """Plans sent and not answered, at most (observability: does the engine overlap?)."""
        return self._pending.most


def _capacity_of(runners: list[ModelRunner]) -> WorldCapacity:
    """The capacity of runners built elsewhere (tests), whose swap bandwidth nobody measured: each one's Ready
    as it would report it (without its compact pool)."""
    readies = []
    for r in runners:
        block_bytes = sum(t[0].nbytes for layer in r.kv_cache for t in layer.tensors())
        # host "swap" in the same process is a memory copy: swap is the cheap preemption
        ready = WorkerReady(
            r.comm.where.rank, r.num_blocks, r.num_blocks * block_bytes, r.moves.num_host_blocks, 1e12,
            format_name(r.kv_cache[0].k.dtype), kv_address=r.handoff.address if r.handoff is not None else "",
        )  # fmt: skip
        readies.append(r.moves.offload.report(ready) if r.moves.offload is not None else ready)
    return WorldCapacity.of(readies)
