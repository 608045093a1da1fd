"""Suspects of a step that failed with nobody blamed: steps alternate between everyone else and one suspect alone,
a suspect leaves once it has sampled (or ended), and a turn with nothing to run gives way to the next at once."""

from __future__ import annotations

import pytest

from scheduler_node.core.quarantine import Quarantine
from tests.scheduler_node.core.test_scheduler import make, req, sample_all
from tests.support.plans import scheduled

pytestmark = pytest.mark.unit


def test_steps_alternate_between_the_others_and_each_suspect_alone() -> None:
    s = make(budget=64)
    for name in ("a", "b", "c", "d"):
        s.add(req(name, 4, max_tokens=3))
    s.quarantine.add(["b", "c"])
    seen = []
    for _ in range(4):
        plan = s.schedule()
        seen.append(sorted(scheduled(s, plan)))
        assert not s.quarantine.planned(plan.has_work)
        s.update(plan, sample_all(plan, s))
        for name in ("b", "c"):  # what the engine does after a result: a suspect that sampled is innocent
            r = s.requests.get(name)
            if r is not None and r.output_token_ids:
                s.quarantine.release(name)
    # b sampled alone, so it is innocent and runs with the others from then on
    assert seen == [["a", "d"], ["b"], ["a", "b", "d"], ["c"]]
    assert not s.quarantine.active, "each suspect sampled alone: both left"


def test_a_turn_with_nothing_to_run_gives_way_and_an_ended_suspect_leaves() -> None:
    q = Quarantine()
    q.add(["x", "y"])
    excluded = q.excluded()
    assert excluded is not None and excluded(req("x", 1)) and not excluded(req("z", 1))  # the normal turn
    assert q.planned(has_work=False), "the normal turn was empty: x's turn next, at once"
    assert q.alone == "x"
    assert q.planned(has_work=False) and q.alone == "y"
    assert not q.planned(has_work=False), "every turn came out empty: wait for results"
    q.release("y")
    q.release("x")
    assert not q.active and q.excluded() is None and q.alone is None


def test_a_finished_request_leaves_quarantine() -> None:
    s = make()
    s.add(req("a", 4))
    s.quarantine.add(["a"])
    s.finish("a", s.requests["a"].status)
    assert not s.quarantine.active
