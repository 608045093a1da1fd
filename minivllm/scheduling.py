"""The articles' scheduling lines, as thin façades over the scheduling policies (scheduler_node/core/policy.py).

    from minivllm import LLM, PriorityScheduler, Scheduler

    scheduler = PriorityScheduler(default_priority=50, priority_ranges={"realtime": (80, 100), "batch": (20, 40)})
    llm = LLM(model, scheduler=scheduler)
    llm.generate(prompts, params, priority=["realtime", "batch"])   # or numbers; higher runs first

    class CustomScheduler(Scheduler):
        def schedule(self):
            if self.load > 0.8:
                return self.priority_schedule()
            return self.fifo_schedule()

    llm = LLM(model, scheduler=CustomScheduler())

`Scheduler` is not the scheduler itself (scheduler_node/core/scheduler.py, which batches, allocates KV blocks and
preempts): it is the policy hook that scheduler consults, `StepChoice`. Its `schedule()` runs as each step begins
and returns the policy that orders that step. On the servers the same class is named by `--scheduling-policy
my_module:CustomScheduler`, and a PriorityScheduler is `--scheduling-policy priority --default-priority 50
--priority-ranges realtime=80-100,batch=20-40`. An engine takes either one through `engine_policy`, which `LLM` and
`AsyncLLMEngine` call with their `scheduler=` keyword.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from scheduler_node.api.validation import priority_from
from scheduler_node.core.policy import Policy, PriorityPolicy, StepChoice
from settings.engine import AGING_INTERVAL_S, PREEMPTION_MARGIN
from settings.priority import DEFAULT_PRIORITY, PriorityConfig, priority_ranges_text


class Scheduler(StepChoice):
    """Subclass it and override `schedule()`: return `self.priority_schedule()` or `self.fifo_schedule()` (or any
    Policy) for the step about to be scheduled, reading `self.load` (the larger of running sequences /
    max_num_seqs and device KV blocks in use / all of them, 0..1)."""


class PriorityScheduler(PriorityPolicy):
    """Requests in order of priority (higher first; a request that names none gets `default_priority`), with named
    ranges a request may give instead of a number: `priority="realtime"` stands for its range's middle."""

    def __init__(
        self,
        default_priority: int = DEFAULT_PRIORITY,
        priority_ranges: Mapping[str, Sequence[int]] | str | None = None,
        aging_interval: float = AGING_INTERVAL_S,
        preemption_margin: float = PREEMPTION_MARGIN,
    ) -> None:
        """ValueError naming default_priority (not an int32) or priority_ranges (a bad name, a range out of order,
        two that overlap)."""
        super().__init__(aging_interval, preemption_margin)
        self.config = PriorityConfig(default_priority, priority_ranges_text(priority_ranges or ""))

    @property
    def default_priority(self) -> int:
        return self.config.default_priority

    @property
    def priority_ranges(self) -> dict[str, tuple[int, int]]:
        return {r.name: (r.low, r.high) for r in self.config.ranges}

    def priority_of(self, priority: int | str | None) -> int:
        """A request's priority as a number: itself, its range's middle, or the default. ValueError naming
        `priority` for a name that is not a range's."""
        return priority_from(priority, None, self.config)


SchedulerArg = Policy | type[Policy]


def engine_policy(scheduler: SchedulerArg | None, settings: MutableMapping[str, Any]) -> Policy | None:
    """The policy an engine built with `settings` orders its requests with (None: the one `scheduling_policy`
    names), given a `scheduler=` keyword: a Policy (a `Scheduler` subclass's instance, a PriorityScheduler), or a
    Policy class, made with the settings' aging_interval and preemption_margin. A PriorityScheduler's default and
    ranges become the settings the doors read (`default_priority`, `priority_ranges`). ValueError naming what is
    given twice; TypeError for what is not a policy."""
    if scheduler is None:
        return None
    given = [k for k in ("scheduling_policy", "default_priority", "priority_ranges") if k in settings]
    if isinstance(scheduler, type) and issubclass(scheduler, Policy):
        margin = settings.get("preemption_margin", PREEMPTION_MARGIN)
        scheduler = scheduler(aging_interval=settings.get("aging_interval", AGING_INTERVAL_S), preemption_margin=margin)
    if not isinstance(scheduler, Policy):
        raise TypeError(
            f"scheduler: must be a PriorityScheduler, a minivllm.Scheduler subclass or a Policy, got {scheduler!r}"
        )
    if isinstance(scheduler, PriorityScheduler):
        if given:
            raise ValueError(f"{given[0]}: set by scheduler=PriorityScheduler(...); give it there, not twice")
        settings["default_priority"] = scheduler.default_priority
        settings["priority_ranges"] = scheduler.config.priority_ranges
    elif "scheduling_policy" in settings:
        raise ValueError("scheduling_policy: scheduler= already names the policy; give one of them")
    return scheduler
