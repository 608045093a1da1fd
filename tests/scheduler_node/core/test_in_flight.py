"""The in-flight ledger: what a plan sent and not yet answered did, kept until its result (or interruption) is
settled; with disjoint plans (P > 1 stages) the requests of a plan in flight are held from the next plans."""

from __future__ import annotations

import pytest

from proto.wire import SamplingOptions
from scheduler_node.core.in_flight import InFlightLedger, SentPlan
from scheduler_node.core.request import Request, StopConditions

pytestmark = pytest.mark.unit


def request(req_id: str, handle: int, computed: int = 0, preemptions: int = 0) -> Request:
    req = Request(req_id, [1, 2, 3, 4], SamplingOptions(temperature=0.0), StopConditions(8))
    req.handle, req.num_computed_tokens, req.num_preemptions = handle, computed, preemptions
    return req


def test_a_sent_plan_records_each_request_as_it_stood() -> None:
    a, b = request("a", 1, computed=4), request("b", 2, computed=2, preemptions=1)
    sent = SentPlan()
    sent.add(a, 1, True)
    sent.add(b, 2, False)  # a chunk of its prompt: nothing sampled yet
    a.num_computed_tokens = 99  # later changes do not rewrite what was sent
    assert (sent.requests, sent.tokens, sent.ends, sent.samples, sent.runs) == (
        [a, b], [1, 2], [4, 2], [True, False], [0, 1])  # fmt: skip
    assert sent.total_tokens == 3 and SentPlan().total_tokens == 0
    sent.add_decodes([request("c", 3, computed=7), request("d", 4, computed=9)], [7, 9])
    assert sent.total_tokens == sum(sent.tokens) == 5  # counted as added, never summed again


@pytest.mark.parametrize("disjoint", [False, True])
def test_plans_are_settled_by_step_and_hold_their_requests_only_when_disjoint(disjoint: bool) -> None:
    ledger = InFlightLedger(disjoint_plans=disjoint)
    a, b, c = request("a", 1), request("b", 2), request("c", 3)
    first, second = SentPlan(), SentPlan()
    first.add(a, 4, True)
    first.add(b, 4, True)
    second.add(c, 4, True)
    ledger.record(1, first)
    ledger.record(2, second)
    assert len(ledger) == 2 and ledger.requests_of(1) == [a, b] and ledger.requests_of(7) == []
    assert (ledger.tokens_of(1), ledger.tokens_of(2), ledger.tokens_of(7)) == (8, 4, 0)
    assert [ledger.held(h) for h in (1, 2, 3, 4)] == [disjoint, disjoint, disjoint, False]
    assert ledger.settle(1) is first
    assert len(ledger) == 1 and [ledger.held(h) for h in (1, 2, 3)] == [False, False, disjoint]
    empty = ledger.settle(1)  # settled already (or never computed anything): an empty entry
    assert empty.requests == [] and len(ledger) == 1
    ledger.clear()  # a rank was lost: every plan in flight was dropped
    assert len(ledger) == 0 and not ledger.held(3) and ledger.requests_of(2) == []
