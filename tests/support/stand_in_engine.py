"""An EngineCore over stand-in workers (scheduler_node/engine/stand_in.py): the real scheduler, block table and
engine loop, no model. For unit tests of the engine core and of the doors.

`ControlledWorkers` adds what a test of failures needs: answers held until released (a slow or hung step), a
step that fails, a rank lost and a replacement rejoining (wait_ready really waits)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from proto.transport import StepFailed, WorkerLost
from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import make_policy
from scheduler_node.core.request import RequestSpec
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.model_path import resolve_model
from scheduler_node.engine.outputs import Delta, RequestStream
from scheduler_node.engine.stand_in import StandInWorkers
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.waiting import until

BLOCK = 16
TOKEN = 7  # what the stand-in workers sample


@functools.cache
def default_tokenizer() -> ModelTokenizer:
    """The default model's tokenizer (SmolLM2's, shared by the tiny models), loaded once."""
    return ModelTokenizer(resolve_model("default"))


class ControlledWorkers(StandInWorkers):
    """Stand-in workers a test steers. With `hold`, answers wait for `release()`; `fail_next` makes the next
    answered plan a StepFailed (the engine drops the plans behind it); `lose()` drops the world (every plan in
    flight fails with WorkerLost, the held requests are gone) until `rejoin()`."""

    def __init__(self, num_kv_blocks: int = 64, hold: bool = False) -> None:
        super().__init__(num_kv_blocks, token=TOKEN, block_size=BLOCK)
        self.hold = hold
        self.fail_next = ""
        self.pending: list[tuple[StepPlan, asyncio.Future[StepResult]]] = []
        self.declared: list[str] = []  # the engine's declare_lost reasons
        self._ready = asyncio.Event()
        self._ready.set()

    def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        if not self.hold:
            return super().submit(plan)
        if self.lost.is_set():
            raise WorkerLost(self.lost_reason)
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self.plans += 1
        self.pending.append((plan, future))
        return future

    async def until_sent(self, timeout: float = 10.0) -> None:
        """Until the engine has sent a plan (held, with `hold`)."""
        await until(lambda: self.pending, timeout, "a plan is sent")

    def release(self) -> None:
        """Answer every held plan, in order (from now on, answer at once)."""
        self.hold = False
        pending, self.pending = self.pending, []
        for plan, future in pending:
            if future.done():
                continue  # the engine dropped it
            if self.fail_next:  # the plans behind it are dropped by the engine: never answered
                future.set_exception(StepFailed(self.fail_next))
                self.fail_next = ""
                return
            future.set_result(self.execute(plan))

    def lose(self) -> None:
        self.lost.set()
        self.changed.set()
        self._ready.clear()
        for _, future in self.pending:
            if not future.done():
                future.set_exception(WorkerLost(self.lost_reason))
        self.pending.clear()
        self.held.clear()  # a replacement starts empty

    def rejoin(self) -> None:
        self.lost.clear()
        self._ready.set()
        self.changed.set()

    def declare_lost(self, reason: str) -> None:
        self.declared.append(reason)
        self.lose()

    async def wait_ready(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


def stand_in_engine(
    options: EngineOptions | None = None,
    workers: StandInWorkers | None = None,
    num_blocks: int = 64,
    max_num_seqs: int = 4,
) -> EngineCore:
    """An engine over stand-in workers (default: ones that answer at once) holding `num_blocks` KV blocks."""
    config = SchedulerConfig(
        block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=max_num_seqs, max_model_len=num_blocks * BLOCK
    )
    mode = ExecutionMode.for_world(1, 1, async_scheduling=True)
    scheduler = Scheduler(config, num_blocks, make_policy("fcfs"), mode)
    workers = workers or StandInWorkers(num_blocks, token=TOKEN, block_size=BLOCK)
    return EngineCore(scheduler, default_tokenizer(), workers, options)


def spec(request_id: str, max_tokens: int = 4, prompt: int = 20, n: int = 1, seed: int = 0) -> RequestSpec:
    """A greedy request of `prompt` distinct tokens (offset by `seed`, so prompts share no prefix), no eos."""
    ids = list(range(100 + 1000 * seed, 100 + 1000 * seed + prompt))
    return RequestSpec(request_id, ids, SamplingOptions(temperature=0.0), max_tokens, [], True, n, 0)


@asynccontextmanager
async def running(engine: EngineCore) -> AsyncIterator[asyncio.Task[None]]:
    """The engine's loop, running for the block's duration (cancelled after it)."""
    task = asyncio.ensure_future(engine.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def collect(stream: RequestStream) -> list[Delta]:
    return [delta async for delta in stream]
