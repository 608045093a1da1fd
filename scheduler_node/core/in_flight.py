"""The in-flight ledger: what each plan sent and not yet answered did to the scheduler's view.

When a result comes back, its plan's entry says which requests it computed up to where (blocks full by then get
registered for prefix caching) and which of them sampled; when the workers skipped a plan (an interrupt), the same
entry says how to roll its requests back. With disjoint plans (P > 1 stages) it also knows which requests are held
by a plan in flight, so none is scheduled twice before its token is known.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SentPlan:
    ends: dict[str, int] = field(default_factory=dict)  # each request's computed tokens once the step ran
    samplers: set[str] = field(default_factory=set)  # requests whose next token this step samples


class InFlightLedger:
    def __init__(self, disjoint_plans: bool) -> None:
        self.disjoint_plans = disjoint_plans
        self._plans: dict[int, SentPlan] = {}
        self._held: set[str] = set()  # with disjoint plans: requests of plans whose results are not applied

    def record(self, step_id: int, req_id: str, end: int, samples: bool) -> None:
        sent = self._plans.get(step_id)
        if sent is None:
            sent = self._plans[step_id] = SentPlan()
        sent.ends[req_id] = end
        if samples:
            sent.samplers.add(req_id)
        if self.disjoint_plans:
            self._held.add(req_id)

    def held(self, req_id: str) -> bool:
        """Is `req_id` in a plan in flight that must come back before it is scheduled again?"""
        return req_id in self._held

    def settle(self, step_id: int, req_ids: list[str]) -> SentPlan:
        """The plan's result (or interruption) arrived: its entry, and its requests are free to schedule."""
        for req_id in req_ids:
            self._held.discard(req_id)
        return self._plans.pop(step_id, None) or SentPlan()

    def clear(self) -> None:
        """Every plan in flight was dropped (a rank was lost)."""
        self._plans.clear()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._plans)
