"""The real EngineCore and Scheduler over stand-in workers (scheduler_node/engine/stand_in.py): no model, no torch,
milliseconds a step. `StandInRun` starts the engine loop on the running event loop; `until_idle` waits, with no
clock, until every request ended, and fails when the loop died, stopped stepping with requests live, or stepped
past a bound. `stand_in_engine` over `ControlledWorkers` is an engine a test steers through failures: answers
held until released (a slow or hung step), a step that fails, a rank lost and a replacement rejoining."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from proto.transport import StepFailed, WorkerLost
from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import make_policy
from scheduler_node.core.request import RequestSpec
from scheduler_node.core.scheduler import PreemptionCosts, Scheduler
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.model_path import resolve_model
from scheduler_node.engine.outputs import Delta, RequestStream
from scheduler_node.engine.stand_in import StandInWorkers
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.waiting import until

QUIET_TURNS = 2_000  # event-loop turns with live requests and no step: the engine is stuck


@functools.cache
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model("default"))


def spec(
    request_id: str, prompt_len: int, max_tokens: int, n: int = 1, priority: int = 50, first: int = 100
) -> RequestSpec:
    """A greedy request of `prompt_len` distinct tokens from `first` on that ignores eos (its output is max_tokens
    long)."""
    return RequestSpec(
        request_id=request_id,
        prompt_token_ids=[first + i for i in range(prompt_len)],
        sampling=SamplingOptions(temperature=0.0),
        max_tokens=max_tokens,
        stop=[],
        ignore_eos=True,
        n=n,
        priority=priority,
    )


@dataclass
class StandInRun:
    engine: EngineCore
    workers: StandInWorkers
    task: asyncio.Task[None] | None = None
    streams: dict[str, RequestStream] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        config: SchedulerConfig,
        num_blocks: int,
        *,
        mode: ExecutionMode | None = None,
        policy: str = "fcfs",
        num_swap_blocks: int = 0,
        options: EngineOptions | None = None,
    ) -> StandInRun:
        mode = mode or ExecutionMode.for_world(1, 1, async_scheduling=True)
        costs = PreemptionCosts(bytes_per_block=1, swap_bytes_per_s=1e6)  # elastic: swap mostly
        scheduler = Scheduler(config, num_blocks, make_policy(policy), mode, num_swap_blocks, costs)
        workers = StandInWorkers(
            num_blocks,
            num_swap_blocks,
            tokens_in_plan=mode.tokens_in_plan,
            block_size=config.block_size,
            acceptance=random.Random(num_blocks) if config.speculative is not None else None,
        )
        return cls(EngineCore(scheduler, tokenizer(), workers, options or EngineOptions()), workers)

    def start(self) -> None:
        """Start the engine loop on the running event loop."""
        self.task = asyncio.get_running_loop().create_task(self.engine.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def submit(self, request: RequestSpec) -> RequestStream:
        self.streams[request.request_id] = stream = self.engine.submit(request)
        return stream

    async def until_idle(self, step_bound: int = 10_000) -> None:
        """Until no request is live and the workers were told everything."""
        engine, workers, task = self.engine, self.workers, self.task
        assert task is not None, "start() first"
        quiet, last = 0, -1
        while engine.num_live or engine.scheduler.has_work or not workers.all_ready:
            assert not task.done(), f"the engine loop died: {engine.failed or task}"
            await asyncio.sleep(0)
            quiet = quiet + 1 if workers.plans == last else 0
            last = workers.plans
            assert quiet < QUIET_TURNS, (
                f"stuck: {engine.num_live} live request(s) and no step "
                f"(waiting {len(engine.scheduler.waiting)}, running {len(engine.scheduler.running)})"
            )
            assert workers.plans < step_bound, f"{workers.plans} steps and still {engine.num_live} live request(s)"
        assert not engine.failed, engine.failed

    def ends(self, request_id: str) -> list[Delta]:
        """The deltas that ended the request's sequences (call once it is idle)."""
        return [d for d in self.streams[request_id].take_ready() if d.finish_reason]

    def assert_idle(self) -> None:
        """Nothing is left anywhere: no request, no block, nothing on the workers."""
        s = self.engine.scheduler
        assert not s.requests and not s.waiting and not s.running, "requests left at idle"
        assert s.blocks.num_used == 0, f"{s.blocks.num_used} blocks held at idle"
        assert s.blocks.num_host_used == 0, "swap blocks held at idle"
        assert not self.workers.held, "the workers still hold requests at idle"
        s.blocks.check_invariants()


# ---- an engine a test steers: its workers hold, fail, are lost and rejoin on demand

BLOCK = 16
TOKEN = 7  # what the stand-in workers sample


class ControlledWorkers(StandInWorkers):
    """Stand-in workers a test steers. With `hold`, answers wait for `release()`; `fail_next` makes the next
    answered plan a StepFailed (the engine drops the plans behind it); `lose()` drops the world (every plan in
    flight fails with WorkerLost, the held requests are gone) until `rejoin()`."""

    def __init__(self, num_kv_blocks: int = 64, hold: bool = False) -> None:
        super().__init__(num_kv_blocks, token=TOKEN, block_size=BLOCK)
        self.hold = hold
        self.fail_next = ""
        self.blame: tuple[int, ...] = ()  # the handles the next failure names (StepError.handles)
        self.unusable: tuple[int, ...] = ()  # the adapters the next failure says cannot be used (StepError.adapters)
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
                future.set_exception(StepFailed(self.fail_next, self.blame, self.unusable))
                self.fail_next, self.blame, self.unusable = "", (), ()
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
    return EngineCore(scheduler, tokenizer(), workers, options)


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


class ScriptedWorkers(StandInWorkers):
    """Stand-in workers whose every request's output is `script` (token ids) and then `eos`: a model that answers
    what a test needs it to (a tool call a tiny random model would never write)."""

    def __init__(self, script: list[int], eos: int, num_kv_blocks: int = 64) -> None:
        super().__init__(num_kv_blocks, block_size=BLOCK)
        self.script = [*script, eos]
        self.written: dict[int, int] = {}  # handle -> tokens sampled

    def execute(self, plan: StepPlan, skip: bool = False) -> StepResult:
        for new in plan.new_requests:
            self.written[new.handle] = len(new.output_token_ids)
        result = super().execute(plan, skip)
        for handle in result.sampled:
            at = min(self.written[handle], len(self.script) - 1)
            result.sampled[handle] = [self.script[at]]
            self.written[handle] += 1
        return result
