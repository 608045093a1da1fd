"""The engine core's collaborators on their own: the plans in flight (engine/in_flight.py) and the serving state
(engine/serving_state.py), driven without the loop. The engine's behaviour through its loop is in test_core.py."""

from __future__ import annotations

import asyncio

import pytest

from proto.transport import WorkerLost
from scheduler_node.engine.in_flight import PlansInFlight
from scheduler_node.engine.serving_state import ServingState
from tests.support.stand_in import ControlledWorkers, spec, stand_in_engine

pytestmark = pytest.mark.unit


def test_plans_in_flight_stay_within_the_mode_and_are_answered_oldest_first() -> None:
    async def scenario() -> tuple[int, int, list[int], list[int]]:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(workers=workers)
        engine.submit(spec("a", 20, 8))
        # Its own, beside the engine's (whose loop does not run): what it is handed is all it uses.
        plans = PlansInFlight(engine.scheduler, workers, engine.metrics, engine.outputs, None, asyncio.Event())
        plans.fill()
        plans.fill()  # no room: nothing more is sent
        sent = [plan.step_id for plan, _ in workers.pending]
        workers.release()
        answered = []
        while plans:
            result = await plans.await_head(step_timeout=60.0)
            answered.append(plans.pop().plan.step_id)
            assert result.step_id == answered[-1]
        return engine.mode.plans_in_flight, len(sent), sent, answered

    limit, sent_count, sent, answered = asyncio.run(scenario())
    assert sent_count == limit == 2, "async scheduling keeps two plans on the workers, never more"
    assert answered == sent, "results are consumed in the order the plans were sent"


def test_a_plan_past_its_deadline_fails_with_its_ranks_lost() -> None:
    async def scenario() -> list[str]:
        workers = ControlledWorkers(hold=True)
        engine = stand_in_engine(workers=workers)
        engine.submit(spec("a", 1, 4))  # one token: its deadline is step_timeout + 0.02 s
        engine.plans.fill()
        with pytest.raises(WorkerLost):
            await engine.plans.await_head(step_timeout=0.05)
        engine.plans.drop()
        assert not engine.plans
        return workers.declared

    declared = asyncio.run(scenario())
    assert len(declared) == 1 and "deadline" in declared[0]


def test_no_interrupt_without_plans_in_flight() -> None:
    async def scenario() -> bool:
        return stand_in_engine().plans.interrupt()

    assert not asyncio.run(scenario())


def test_the_serving_state_says_why_requests_are_refused() -> None:
    state = ServingState()
    assert state.refusal() == ""
    state.gave_up = "rank 1 lost, and no worker rejoined within 60 s"
    assert state.refusal() == state.gave_up
    state.failed = "engine failed: boom"
    assert state.refusal() == "engine failed: boom", "a loop that stopped for good is the first reason"
    state.draining = True
    assert "draining" in state.refusal(), "a draining server says so, whatever else holds"
