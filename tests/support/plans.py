"""Plans and results as the scheduler tests read and write them: requests by their string ids (on the wire they
are integer handles the scheduler assigned)."""

from __future__ import annotations

from proto.wire import StepPlan
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
