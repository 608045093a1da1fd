"""The in-flight ledger: what each plan sent and not yet answered did to the scheduler's view.

When a result comes back, its plan's entry says which requests it computed, how many tokens and up to where (the
blocks they filled get registered for prefix caching), and which of them sampled; when the workers skipped a plan
(an interrupt), the same entry says how to roll its requests back. With disjoint plans (P > 1 stages) it also knows
which requests are held by a plan in flight, so none is scheduled twice before its token is known; so does a
speculating request's plan (its accepted tokens are known only once its result is back). Entries are
columns appended to as the plan is built: no per-request object.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from scheduler_node.core.request import Request

_HANDLE, _PREEMPTIONS = operator.attrgetter("handle"), operator.attrgetter("num_preemptions")
_NEXT = (1).__add__


@dataclass(slots=True)
class SentPlan:
    requests: list[Request] = field(default_factory=list)  # in the order they were scheduled
    tokens: list[int] = field(default_factory=list)  # each one's tokens computed by this step
    ends: list[int] = field(default_factory=list)  # each one's computed tokens once the step ran
    samples: list[bool] = field(default_factory=list)  # does this step sample its next token?
    # Each one's preemptions when sent: a request preempted since (and maybe started again) is another run of it,
    # which this plan's progress is not part of.
    runs: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # each one's proposed tokens (speculative decoding), within tokens
    num_drafted: int = 0  # requests with proposals: none, and nothing about proposals costs a pass over the plan
    total_tokens: int = 0  # the sum of `tokens` as sent, counted as they are added (no pass over the plan)
    # The steady decodes among them (`add_decodes`): their handles and computed tokens before the step, the plan's
    # packed decodes once it is built (StepPlan.decode_handles, decode_computed).
    decode_handles: list[int] = field(default_factory=list)
    decode_firsts: list[int] = field(default_factory=list)

    def add(self, req: Request, tokens: int, samples: bool, drafts: int = 0) -> None:
        self.requests.append(req)
        self.drafts.append(drafts)
        if drafts:
            self.num_drafted += 1
        self.tokens.append(tokens)
        self.total_tokens += tokens
        self.ends.append(req.num_computed_tokens)
        self.samples.append(samples)
        self.runs.append(req.num_preemptions)

    def add_decodes(self, reqs: list[Request], firsts: list[int]) -> None:
        """Steady decodes, added together: each computes the one token after `firsts[i]` and samples it."""
        k = len(reqs)
        self.decode_handles += map(_HANDLE, reqs)  # the columns in C: no Python frame per request
        self.decode_firsts += firsts
        self.requests += reqs
        self.drafts += [0] * k
        self.tokens += [1] * k
        self.total_tokens += k
        self.ends += map(_NEXT, firsts)
        self.samples += [True] * k
        self.runs += map(_PREEMPTIONS, reqs)


class InFlightLedger:
    def __init__(self, disjoint_plans: bool) -> None:
        self.disjoint_plans = disjoint_plans
        self._plans: dict[int, SentPlan] = {}
        self._held: set[int] = set()  # with disjoint plans: handles of requests in plans whose results are not applied

    def record(self, step_id: int, sent: SentPlan) -> None:
        """A plan that computes something goes out; with disjoint plans its requests are held until it is back."""
        self._plans[step_id] = sent
        if self.disjoint_plans:
            self._held.update(r.handle for r in sent.requests)
        elif sent.num_drafted:  # a speculating request's next tokens are known only once this result is back
            self._held.update(r.handle for r, d in zip(sent.requests, sent.drafts) if d)

    def tokens_of(self, step_id: int) -> int:
        """The tokens a plan in flight computes (0 for one that computes none: it is not recorded)."""
        sent = self._plans.get(step_id)
        return sent.total_tokens if sent is not None else 0

    def requests_of(self, step_id: int) -> list[Request]:
        """The requests a plan in flight computes."""
        sent = self._plans.get(step_id)
        return sent.requests if sent is not None else []

    def first_computed(self, req: Request) -> int | None:
        """The first position of `req` (its current run) that a plan in flight computes; None if none does."""
        firsts = [
            end - n
            for sent in self._plans.values()
            for r, n, end, run in zip(sent.requests, sent.tokens, sent.ends, sent.runs)
            if r is req and run == req.num_preemptions
        ]
        return min(firsts, default=None)

    @property
    def holds_any(self) -> bool:
        return bool(self._held)

    def held(self, handle: int) -> bool:
        """Is the request in a plan in flight that must come back before it is scheduled again?"""
        return handle in self._held

    def settle(self, step_id: int) -> SentPlan:
        """The plan's result (or interruption) arrived: its entry, and its requests are free to schedule."""
        sent = self._plans.pop(step_id, None) or SentPlan()
        if self._held:
            self._held.difference_update(r.handle for r in sent.requests)
        return sent

    def clear(self) -> None:
        """Every plan in flight was dropped (a rank was lost)."""
        self._plans.clear()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._plans)
