"""The real EngineCore and Scheduler over stand-in workers (scheduler_node/engine/stand_in.py): no model, no torch,
milliseconds a step. `StandInRun` starts the engine loop on the running event loop; `until_idle` waits, with no
clock, until every request ended, and fails when the loop died, stopped stepping with requests live, or stepped
past a bound."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

from proto.wire import ExecutionMode, SamplingOptions
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import make_policy
from scheduler_node.core.request import RequestSpec
from scheduler_node.core.scheduler import PreemptionCosts, Scheduler
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.model_path import resolve_model
from scheduler_node.engine.outputs import Delta, RequestStream
from scheduler_node.engine.stand_in import StandInWorkers
from scheduler_node.text.tokenizer import ModelTokenizer

QUIET_TURNS = 2_000  # event-loop turns with live requests and no step: the engine is stuck


@functools.cache
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model("default"))


def spec(request_id: str, prompt_len: int, max_tokens: int, n: int = 1, priority: int = 50) -> RequestSpec:
    """A greedy request of `prompt_len` distinct tokens that ignores eos (its output is max_tokens long)."""
    return RequestSpec(
        request_id=request_id,
        prompt_token_ids=[100 + i for i in range(prompt_len)],
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
            num_blocks, num_swap_blocks, tokens_in_plan=mode.tokens_in_plan, block_size=config.block_size
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
