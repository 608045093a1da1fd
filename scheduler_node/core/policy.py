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
`--scheduling-policy my_module:MyPolicy` (see deploy/custom_policy.py).
"""

from __future__ import annotations

from collections.abc import Iterable
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
