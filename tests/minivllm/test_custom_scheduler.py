"""minivllm.Scheduler (seed 000, 6.3): a subclass's schedule() picks each step's order; the engine runs it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, SamplingParams, Scheduler
from proto.wire import ExecutionMode
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import Policy, make_policy
from scheduler_node.core.scheduler import Scheduler as CoreScheduler
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.stand_in import StandInWorkers
from tests.seeds.blocks import block
from tests.support.stand_in import collect, spec, tokenizer

pytestmark = pytest.mark.model


# The article's class, as written (tests/seeds/blocks.py), defined in this module so servers load it by its path.
_article: dict[str, Any] = {"Scheduler": Scheduler, "__name__": __name__}
exec(block("custom_scheduler").text, _article)
CustomScheduler = _article["CustomScheduler"]


class Always(Scheduler):
    """One order every step, and a record of the loads it read."""

    def __init__(self, by_priority: bool, **kwargs: float) -> None:
        super().__init__(**kwargs)
        self.by_priority = by_priority
        self.loads: list[float] = []

    def schedule(self) -> Policy:
        self.loads.append(self.load)
        return self.priority_schedule() if self.by_priority else self.fifo_schedule()


def finish_order(policy: Policy, priorities: dict[str, int]) -> list[str]:
    """The order requests end in on the real engine core and scheduler over stand-in workers, one seat, every
    request queued before the first step."""
    config = SchedulerConfig(block_size=16, max_num_batched_tokens=256, max_num_seqs=1, max_model_len=1024)
    mode = ExecutionMode.for_world(1, 1, async_scheduling=False)
    options = EngineOptions(output_thread=False)  # deltas reach the streams in the loop's order, as they end
    workers = StandInWorkers(64, block_size=16)
    engine = EngineCore(CoreScheduler(config, 64, policy, mode), tokenizer(), workers, options)
    ended: list[str] = []

    async def scenario() -> None:
        async def one(request_id: str, stream) -> None:  # type: ignore[no-untyped-def]
            await collect(stream)
            ended.append(request_id)

        streams = {rid: engine.submit(spec(rid, 8, 3, priority=p, first=100 + 20 * i))
                   for i, (rid, p) in enumerate(priorities.items())}  # fmt: skip
        task = asyncio.ensure_future(engine.run())
        try:
            await asyncio.wait_for(asyncio.gather(*(one(r, s) for r, s in streams.items())), 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    return ended


PRIORITIES = {"batch": 30, "normal": 50, "realtime": 90}  # in order of arrival


def test_the_schedule_choice_changes_the_order_requests_finish_in() -> None:
    assert finish_order(Always(by_priority=False), PRIORITIES) == ["batch", "normal", "realtime"]
    by_priority = Always(by_priority=True)
    assert finish_order(by_priority, PRIORITIES) == ["realtime", "normal", "batch"]
    assert max(by_priority.loads) == 1.0 and min(by_priority.loads) == 0.0  # one seat: taken, then free


def test_the_articles_class_loads_by_dotted_path_as_the_servers_name_it() -> None:
    policy = make_policy("tests.minivllm.test_custom_scheduler:CustomScheduler", aging_interval=3.0)
    assert isinstance(policy, CustomScheduler) and policy.aging_interval == 3.0
    # One seat. A step that finds it free (load 0) goes by arrival: batch starts. A step that finds it taken
    # (load 1) goes by priority: realtime displaces batch. Once realtime ends, the free seat goes to batch again by
    # arrival, and at the next step normal displaces it. Arrival order alone: batch, normal, realtime.
    assert finish_order(policy, PRIORITIES) == ["realtime", "normal", "batch"]
    never_loaded = make_policy("tests.minivllm.test_custom_scheduler:CustomScheduler", preemption_margin=1000.0)
    assert finish_order(never_loaded, PRIORITIES) == ["batch", "normal", "realtime"]  # no displacement: seats free
    # up only between requests, at load 0


def test_llm_runs_the_scheduler_it_is_given(tiny_llama_dir: Path) -> None:
    chooser = Always(by_priority=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_llama_dir), scheduler=chooser, max_num_seqs=2, kv_cache_memory="16MiB", threads=1) as llm:
        assert llm.engine.scheduler.policy is chooser
        outputs = llm.generate(["one", "two", "three"], params, use_tqdm=False, priority=[10, 20, 30])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
    assert chooser.loads and max(chooser.loads) == 1.0  # two seats, both taken while three requests ran


def test_scheduler_and_scheduling_policy_together_are_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(tiny_llama_dir), scheduler=CustomScheduler(), scheduling_policy="priority")
    with pytest.raises(TypeError, match="scheduler: must be"):
        LLM(str(tiny_llama_dir), scheduler="priority")  # type: ignore[arg-type]
