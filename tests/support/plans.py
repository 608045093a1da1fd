"""Plans and results as the scheduler tests read and write them: requests by their string ids (on the wire they
are integer handles the scheduler assigned)."""

from __future__ import annotations

from proto.wire import SamplingOptions, StepPlan, StepResult
from scheduler_node.core.request import Request, StopConditions
from scheduler_node.core.scheduler import Scheduler


def scheduled(s: Scheduler, plan: StepPlan) -> dict[str, int]:
    """Tokens each live request computes in the plan, by request id."""
    return {_id(s, h): n for h, n in plan.num_scheduled_tokens.items()}


def named(s: Scheduler, handles: list[int]) -> list[str]:
    """The ids of the live requests these handles name."""
    return [_id(s, h) for h in handles]


def handle(s: Scheduler, req_id: str) -> int:
    return s.requests[req_id].handle


def by_handle(s: Scheduler, tokens: dict[str, list[int]]) -> dict[int, list[int]]:
    """A result's sampled tokens, from request ids to handles."""
    return {handle(s, r): t for r, t in tokens.items()}


def _id(s: Scheduler, h: int) -> str:
    req = s.request_of(h)
    if req is None:
        raise KeyError(f"handle {h} names no live request")
    return req.req_id


def run_to_end(s: Scheduler, rid: str, prompt: list[int], salt: str = "") -> list[StepPlan]:
    """Add one greedy request of a single output token and step the scheduler until it is done (the workers'
    side stood in: a token once the prompt is computed); the plans it made."""
    s.add(Request(rid, prompt, SamplingOptions(0.0), StopConditions(1, frozenset()), cache_salt=salt))
    plans = []
    while s.has_work:
        plan = s.schedule()
        plans.append(plan)
        done = {
            h: [1]
            for h in plan.num_scheduled_tokens
            if (r := s.request_of(h)) is not None and r.num_computed_tokens == r.num_tokens
        }
        s.update(plan, StepResult(plan.step_id, done))
    return plans
