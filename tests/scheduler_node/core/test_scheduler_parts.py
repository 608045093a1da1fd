"""The scheduler's parts: the step loop's steady-decode path builds the plans and ledgers the general path would,
and `Scheduler` is its state, preemption, admission and results (one module each)."""

from __future__ import annotations

from typing import Any

import pytest

from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult
from scheduler_node.core.admission import Admission
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.in_flight import SentPlan
from scheduler_node.core.preemption import Preemption
from scheduler_node.core.request import Request, StopConditions
from scheduler_node.core.results import RequestOutput, Results
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.core.scheduler_state import SchedulerState

pytestmark = pytest.mark.unit

# (step it arrives at, id, prompt length, max_tokens, forks): decodes that cross blocks, a fork whose parent's
# first decode copies the shared last block, a long prompt chunked among decodes, more than the blocks hold.
ARRIVALS = [
    (0, "a", 5, 30, 0),
    (0, "b", 7, 26, 0),
    (0, "fork", 6, 18, 1),
    (2, "long", 30, 9, 0),
    (4, "c", 3, 25, 0),
    (9, "d", 11, 20, 0),
]


def make(fast: bool) -> tuple[Scheduler, list[int]]:
    """A scheduler of two plans in flight (async scheduling), tight on blocks; `fast=False` turns the steady-decode
    path off. Also a list that counts the decodes the steady path took."""
    cfg = SchedulerConfig(block_size=8, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=256)
    s = Scheduler(cfg, 12, mode=ExecutionMode.for_world(1, 1, True))
    taken: list[int] = []
    take_decodes = s._take_decodes

    def counted(reqs: list[Request], plan: StepPlan, sent: Any) -> None:
        taken.append(len(reqs))
        take_decodes(reqs, plan, sent)

    s._take_decodes = counted  # type: ignore[method-assign]
    if not fast:
        s.view.plain_decodes = lambda: None  # type: ignore[method-assign]
    return s, taken


def arrive(s: Scheduler, step: int) -> None:
    for at, rid, prompt_len, max_tokens, forks in ARRIVALS:
        if at == step:
            prompt = [10 + (i * 7 + len(rid)) % 50 for i in range(prompt_len)]
            sampling, stop = SamplingOptions(0.0), StopConditions(max_tokens, frozenset())
            children = [Request(f"{rid}-{k}", list(prompt), sampling, stop) for k in range(1, forks + 1)]
            s.add(Request(rid, prompt, sampling, stop), forks=children)


def ledger(s: Scheduler, plan: StepPlan) -> tuple[list[Any], ...]:
    """What the in-flight ledger holds of a plan (nothing for a plan of notices only), requests by handle."""
    sent = s.in_flight._plans.get(plan.step_id, SentPlan())
    handles = [r.handle for r in sent.requests]
    return handles, sent.tokens, sent.ends, sent.samples, sent.runs, sent.drafts


def result(s: Scheduler, plan: StepPlan) -> StepResult:
    """What a worker returns: a token for each request the plan samples, from its handle and the step."""
    handles, _, _, samples, _, _ = ledger(s, plan)
    tokens = {h: [100 + (h * 31 + plan.step_id) % 57] for h, yes in zip(handles, samples) if yes}
    return StepResult(plan.step_id, tokens)


def run(fast: bool) -> tuple[list[Any], list[int], int]:
    """Every plan, ledger and output of the scenario, the decodes the steady path took, and the preemptions."""
    s, taken = make(fast)
    trace: list[Any] = []
    in_flight: list[StepPlan] = []
    for step in range(400):
        arrive(s, step)
        plan = s.schedule()
        if plan.has_work:
            in_flight.append(plan)
            trace.append((plan, ledger(s, plan)))
        if len(in_flight) == 2 or (in_flight and not plan.has_work):
            head = in_flight.pop(0)
            outputs = s.update(head, result(s, head))
            trace.append([(o.request.req_id, o.new_token_ids, o.finish_reason) for o in outputs])
        if step > 10 and not s.has_work and not in_flight:
            break
    assert not s.requests, "the scenario ends with every request finished"
    return trace, taken, s.num_preemptions


def test_steady_decodes_make_the_plans_the_general_path_makes() -> None:
    fast, taken, preemptions = run(fast=True)
    general, not_taken, _ = run(fast=False)
    assert fast == general
    assert sum(taken) > 100 and not not_taken  # the steady path ran, and only where it was on
    assert preemptions > 0  # blocks ran short: decodes and preemption met


def test_the_scheduler_is_its_parts() -> None:
    assert Scheduler.__mro__[1:6] == (Admission, Results, Preemption, SchedulerState, object)
    assert Scheduler.update is Results.update and Scheduler._preempt is Preemption._preempt
    assert Scheduler._claim_blocks is Admission._claim_blocks and Scheduler.add is SchedulerState.add
    assert RequestOutput.__module__ == "scheduler_node.core.results"
