"""Scheduling policies decide order and victims; the scheduler applies the one rule under their order.

A policy gives every request an *effective priority* (higher runs first). The scheduler runs requests in
that order, preempts the lowest when KV blocks or seats run out, and lets a waiting request displace a
running one when it beats it by `preemption_margin` (hysteresis: two requests cannot ping-pong).

Policies:
- `fcfs`: arrival order; never preempts for priority.
- `priority`: the request's static `priority` (realtime 80-100, default 50, batch 20-40).
- `dynamic`: hybrid's points (static priority plus one point per `aging_interval` seconds of age), minus one
  point per `short_job_tokens` tokens still to generate: within a class short jobs first, and nobody waits forever.
- `hybrid`: static priority plus one point per `aging_interval` seconds of age.

Starvation bound (hybrid): aging adds points at the same rate to every request, so a request of priority p
outranks a request of priority P once it is older by more than (P - p) x aging_interval. Under a sustained
load that keeps requests of priority at most P waiting, each served within S seconds (so none of them has
waited more than S), it outranks them all after (P - p) x aging_interval + S seconds and starts when the
next seat frees: within (P - p) x aging_interval + 2 S, or earlier, by displacing a running request once it
leads it by the margin. A backlog of priority-P requests that arrived before it keeps its lead and is served
first. `dynamic` ages the same way; its remaining-token term can only add the waiting request's own
max_tokens / short_job_tokens points to the lead it must make up (the others' term only lowers them), so its
bound is (P - p + max_tokens / short_job_tokens) x aging_interval + 2 S. tests/scheduler_node/core/test_policy.py
checks both.

Stable orders: under fcfs and priority the order of two requests never changes (it depends on neither age nor
progress), so the scheduler keeps its queues in that order as requests arrive and start, and no step sorts them.
A subclass that overrides how requests rank (`effective_priority`, `sort_key`, `order_running`, `order_waiting`
or `pick_victim`) is sorted every step, unless it says `stable_order = True`.

Write your own: subclass `Policy`, override `effective_priority` (or the three methods), and load it with
`--scheduling-policy my_module:MyPolicy` (see deploy/custom_policy.py). Or subclass `StepChoice` (public as
`minivllm.Scheduler`) and override `schedule()`, which the scheduler calls at the start of every step and which
returns the policy that orders that step (`self.priority_schedule()`, `self.fifo_schedule()`, or any Policy),
reading `self.load`: the larger of the seats taken (running sequences / max_num_seqs) and the KV blocks in use
(of the device cache), from 0 to 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from scheduler_node.core.request import Request
from settings.engine import AGING_INTERVAL_S, PREEMPTION_MARGIN
from settings.plugins import load_subclass


class Policy:
    """First come, first served. The base class of every policy."""

    name = "fcfs"
    stable_order = True  # see the module's docstring

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ranks = ("effective_priority", "sort_key", "order_running", "order_waiting", "pick_victim")
        if "stable_order" not in cls.__dict__ and any(name in cls.__dict__ for name in ranks):
            cls.stable_order = False

    def __init__(self, aging_interval: float = AGING_INTERVAL_S, preemption_margin: float = PREEMPTION_MARGIN) -> None:
        if aging_interval <= 0:
            raise ValueError(f"aging_interval must be > 0, got {aging_interval}")
        self.aging_interval = aging_interval
        self.preemption_margin = preemption_margin

    def effective_priority(self, req: Request, now: float) -> float:
        return 0.0

    def sort_key(self, req: Request, now: float) -> Any:
        """Smaller runs first: higher effective priority, then earlier arrival."""
        return (-self.effective_priority(req, now), req.arrival_time, req.arrival_seq)

    def order_waiting(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: self.sort_key(r, now))

    def order_running(self, running: Iterable[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: self.sort_key(r, now))

    def pick_victim(self, candidates: list[Request], now: float) -> Request | None:
        """The running request to preempt when memory runs out: the one this policy values least."""
        return max(candidates, key=lambda r: self.sort_key(r, now), default=None)

    def displaces(self, waiting: Request, running: Request, now: float) -> bool:
        """May `waiting` take the place of `running`? Only by a clear margin, so they cannot ping-pong."""
        gap = self.effective_priority(waiting, now) - self.effective_priority(running, now)
        return self.preemption_margin > 0 and gap >= self.preemption_margin

    def _age_points(self, req: Request, now: float) -> float:
        return max(0.0, now - req.arrival_time) / self.aging_interval

    def watch(self, load: Callable[[], float]) -> None:
        """The scheduler that runs this policy hands it its load gauge (0..1); only a StepChoice reads it."""

    def begin_step(self) -> None:
        """Called by the scheduler as each step begins, before any order is decided; only a StepChoice acts."""


class PriorityPolicy(Policy):
    name = "priority"
    stable_order = True

    def effective_priority(self, req: Request, now: float) -> float:
        return float(req.priority)


class DynamicPolicy(Policy):
    name = "dynamic"
    short_job_tokens = 64

    def effective_priority(self, req: Request, now: float) -> float:
        remaining = req.stop.max_tokens - len(req.output_token_ids)
        return req.priority + self._age_points(req, now) - remaining / self.short_job_tokens


class HybridPolicy(Policy):
    name = "hybrid"

    def effective_priority(self, req: Request, now: float) -> float:
        return req.priority + self._age_points(req, now)


class StepChoice(Policy):
    """A policy whose `schedule()` picks, as each step begins, the policy that orders that step's requests (the
    article's `class CustomScheduler(Scheduler)`: `minivllm.Scheduler` is this class). Its order may change from
    one step to the next, so it is never a stable order: the scheduler sorts its queues every step."""

    name = "step_choice"
    stable_order = False

    def __init__(self, aging_interval: float = AGING_INTERVAL_S, preemption_margin: float = PREEMPTION_MARGIN) -> None:
        super().__init__(aging_interval, preemption_margin)
        self._fifo = Policy(aging_interval, preemption_margin)
        self._priority = PriorityPolicy(aging_interval, preemption_margin)
        self._load: Callable[[], float] = lambda: 0.0
        self.current: Policy = self._fifo  # the choice of the step under way

    @property
    def load(self) -> float:
        """The larger of the seats taken (running / max_num_seqs) and the device KV blocks in use, 0..1; 0 before
        the policy runs in a scheduler."""
        return self._load()

    def schedule(self) -> Policy:
        """The policy that orders this step. Override it; the default is arrival order."""
        return self.fifo_schedule()

    def priority_schedule(self) -> Policy:
        """Order by the requests' priority (higher first), displacing lower ones by the margin: `priority`."""
        return self._priority

    def fifo_schedule(self) -> Policy:
        """Order by arrival, never displacing for priority: `fcfs`."""
        return self._fifo

    def watch(self, load: Callable[[], float]) -> None:
        self._load = load

    def begin_step(self) -> None:
        chosen = self.schedule()
        if not isinstance(chosen, Policy):
            raise TypeError(
                f"{type(self).__name__}.schedule() must return a policy (self.priority_schedule(), "
                f"self.fifo_schedule() or a Policy), got {chosen!r}"
            )
        self.current = chosen

    # Every ranking question goes to the step's choice.
    def effective_priority(self, req: Request, now: float) -> float:
        return self.current.effective_priority(req, now)

    def sort_key(self, req: Request, now: float) -> Any:
        return self.current.sort_key(req, now)

    def order_waiting(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return self.current.order_waiting(waiting, now)

    def order_running(self, running: Iterable[Request], now: float) -> list[Request]:
        return self.current.order_running(running, now)

    def pick_victim(self, candidates: list[Request], now: float) -> Request | None:
        return self.current.pick_victim(candidates, now)

    def displaces(self, waiting: Request, running: Request, now: float) -> bool:
        return self.current.displaces(waiting, running, now)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Policy, PriorityPolicy, DynamicPolicy, HybridPolicy)}


def make_policy(
    name: str, aging_interval: float = AGING_INTERVAL_S, preemption_margin: float = PREEMPTION_MARGIN
) -> Policy:
    """A built-in policy by name, or a user's `module:Class` (a subclass of Policy)."""
    if ":" in name:
        cls = load_subclass(name, Policy, "scheduling policy")
    elif name in POLICIES:
        cls = POLICIES[name]
    else:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)} or module:Class")
    return cls(aging_interval=aging_interval, preemption_margin=preemption_margin)
