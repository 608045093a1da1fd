"""A step a worker could not run (StepError): its requests end with INTERNAL — unstarted n > 1 siblings with them —
the others are recomputed, and the workers, which stay up, are told to forget every request they held (none is
left behind holding state and sampler rows)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import make_policy
from scheduler_node.core.request import RequestSpec
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.model_path import resolve_model
from scheduler_node.engine.outputs import Delta
from scheduler_node.engine.stand_in import StandInWorkers
from scheduler_node.text.tokenizer import ModelTokenizer

pytestmark = pytest.mark.unit

BLOCKS = 64
ONE_STAGE = ExecutionMode.for_world(1, 1, async_scheduling=True)
# Two pipeline stages: the plans in flight hold disjoint requests, so a request can be held by the workers and
# outside the plan that fails.
TWO_STAGES = ExecutionMode.for_world(1, 2, async_scheduling=True)


class FailingWorkers(StandInWorkers):
    """Stand-in workers that cannot run the first plan `fails` picks (a StepError, as a real worker's)."""

    def __init__(self, fails: Callable[[StepPlan], bool], mode: ExecutionMode = ONE_STAGE) -> None:
        super().__init__(BLOCKS, tokens_in_plan=mode.tokens_in_plan)
        self.mode = mode
        self.fails = fails
        self.failed_step = 0

    def execute(self, plan: StepPlan, skip: bool = False) -> StepResult:
        if not self.failed_step and self.fails(plan):
            self.failed_step = plan.step_id
            raise ValueError("injected failure")
        return super().execute(plan, skip)


def _engine(workers: FailingWorkers) -> EngineCore:
    config = SchedulerConfig(block_size=16, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256)
    scheduler = Scheduler(config, BLOCKS, make_policy("fcfs"), workers.mode)
    return EngineCore(scheduler, ModelTokenizer(resolve_model("default")), workers)


def _spec(request_id: str, max_tokens: int, n: int = 1) -> RequestSpec:
    sampling = SamplingOptions(temperature=1.0, seed=5)
    return RequestSpec(request_id, list(range(100, 140)), sampling, max_tokens, [], True, n, 0)


async def _collect(engine: EngineCore, spec: RequestSpec) -> list[Delta]:
    return [delta async for delta in engine.submit(spec)]


def _endings(deltas: list[Delta]) -> dict[int, tuple[str, str]]:
    """Each sequence's finish reason and error status ("" when it did not fail)."""
    return {
        d.index: (str(d.finish_reason.value), d.error.status.name if d.error else "")
        for d in deltas
        if d.finish_reason is not None
    }


def test_a_failed_prompt_ends_its_unstarted_siblings_too() -> None:
    workers = FailingWorkers(lambda plan: bool(plan.new_requests))  # the step that computes the prompt

    async def scenario() -> list[Delta]:
        engine = _engine(workers)
        loop = asyncio.ensure_future(engine.run())
        try:
            return await asyncio.wait_for(_collect(engine, _spec("forked", 8, n=3)), 10)
        finally:
            loop.cancel()

    deltas = asyncio.run(scenario())
    assert workers.failed_step
    assert _endings(deltas) == {i: ("error", "INTERNAL") for i in range(3)}, "every sibling ends with the prompt"


def test_the_workers_forget_every_request_after_a_failed_step() -> None:
    """`steady` and `doomed` run in alternate plans (two stages); a plan of `doomed` fails once the workers hold
    both. `doomed` ends with INTERNAL, `steady` is recomputed and finishes, and at idle the workers hold nothing."""
    engine_ref: list[EngineCore] = []

    def doomed_is_held(plan: StepPlan) -> bool:
        engine = engine_ref[0]
        (req_id,) = engine.outputs.requests.get("doomed", [""])
        doomed = engine.scheduler.requests.get(req_id)
        if doomed is None or doomed.handle not in plan.num_scheduled_tokens:
            return False
        return len(doomed.output_token_ids) >= 2 and len(workers.held) == 2

    workers = FailingWorkers(doomed_is_held, TWO_STAGES)

    async def scenario() -> tuple[list[Delta], list[Delta]]:
        engine = _engine(workers)
        engine_ref.append(engine)
        loop = asyncio.ensure_future(engine.run())
        try:
            steady, doomed = await asyncio.wait_for(
                asyncio.gather(_collect(engine, _spec("steady", 12)), _collect(engine, _spec("doomed", 12))), 10
            )
            await asyncio.wait_for(_until(lambda: not engine.scheduler.has_work), 10)
            return steady, doomed
        finally:
            loop.cancel()

    steady, doomed = asyncio.run(scenario())
    assert workers.failed_step
    assert _endings(doomed) == {0: ("error", "INTERNAL")}
    assert _endings(steady) == {0: ("length", "")}
    assert sum(len(d.token_ids) for d in steady) == 12
    assert workers.held == {}, "the workers still hold requests the scheduler forgot"


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.001)
