"""PriorityScheduler (seed 003, 6.3): named ranges a request gives instead of a number, the engine ordering by them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, PriorityScheduler, SamplingParams
from minivllm.scheduling import engine_policy
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.policy import PriorityPolicy
from scheduler_node.core.request import Request
from tests.seeds.blocks import block

pytestmark = pytest.mark.model


def article_scheduler() -> PriorityScheduler:
    namespace: dict[str, Any] = {}
    exec(block("priority_scheduler").text, namespace)  # the article's lines, as written
    scheduler = namespace["scheduler"]
    assert isinstance(scheduler, PriorityScheduler)
    return scheduler


def test_the_articles_scheduler_orders_by_priority_and_names_its_ranges() -> None:
    scheduler = article_scheduler()
    assert isinstance(scheduler, PriorityPolicy) and scheduler.stable_order  # the priority order, unsorted per step
    assert scheduler.priority_ranges == {"realtime": (80, 100), "batch": (20, 40)}
    assert [scheduler.priority_of(p) for p in ("realtime", "batch", None, 90, "75")] == [90, 30, 50, 90, 75]
    with pytest.raises(InvalidField) as err:
        scheduler.priority_of("interactive")
    assert err.value.field == "priority" and "'interactive'" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"priority_ranges": {"realtime": (100, 80)}}, "priority_ranges"),
        ({"priority_ranges": {"realtime": (80, 100), "high": (70, 85)}}, "priority_ranges"),
        ({"default_priority": 2**40}, "default_priority"),
    ],
)
def test_bad_ranges_and_defaults_are_errors_naming_them(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PriorityScheduler(**kwargs)


def test_an_engine_takes_its_order_and_its_doors_settings_from_it() -> None:
    settings: dict[str, Any] = {"max_num_seqs": 2}
    scheduler = article_scheduler()
    assert engine_policy(scheduler, settings) is scheduler
    assert settings == {"max_num_seqs": 2, "default_priority": 50, "priority_ranges": "realtime=80-100,batch=20-40"}
    with pytest.raises(ValueError, match="priority_ranges"):
        engine_policy(scheduler, {"priority_ranges": "a=1-2"})
    made = engine_policy(PriorityScheduler, {"aging_interval": 4.0})  # a class is made with the settings
    assert isinstance(made, PriorityScheduler) and made.aging_interval == 4.0
    assert engine_policy(None, {}) is None


class Recording(PriorityScheduler):
    """The priority each request reached the scheduler with (the order stays the stable priority order)."""

    stable_order = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: dict[str, int] = {}

    def sort_key(self, req: Request, now: float) -> Any:
        self.seen[req.req_id.rpartition("#")[0]] = req.priority  # a sequence's id is REQUEST#N
        return super().sort_key(req, now)


def test_llm_requests_name_their_priority(tiny_llama_dir: Path) -> None:
    scheduler = Recording(default_priority=45, priority_ranges={"realtime": (80, 100), "batch": (20, 40)})
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM(str(tiny_llama_dir), scheduler=scheduler, max_num_seqs=1, kv_cache_memory="16MiB", threads=1) as llm:
        assert llm.engine.scheduler.policy is scheduler
        assert llm.config.options.priorities.named("realtime") == 90
        outputs = llm.generate(["a", "b", "c", "d"], params, use_tqdm=False, priority=["batch", "realtime", 7, None])
        assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)
        assert [scheduler.seen.get(o.request_id) for o in outputs] == [30, 90, 7, 45], scheduler.seen
        with pytest.raises(InvalidField, match="priority"):
            llm.generate("e", params, use_tqdm=False, priority="urgent")
