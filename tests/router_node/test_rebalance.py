"""`vllm-router --rebalance` (router/rebalance.py): which stream moves (the longest-running one of a replica whose
queue is long, while another replica of its model is idle), the replica's side (Control.Migrate: an engine moves
only the requests named, takes none of them back and serves on), and the router's (a moved request's replica stays
in the serving set)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from proto import serving_pb2 as pb
from router_node.migration import Journey
from router_node.rebalance import moves
from router_node.replica import NOT_SERVING, SERVING, Load, ReplicaPool, ReplicaSpec
from scheduler_node.core.request import FinishReason
from tests.support.stand_in import collect, running, spec, stand_in_engine

pytestmark = pytest.mark.unit


def pool(*loads: tuple[str, int, int]) -> ReplicaPool:
    """Serving replicas of (model, running, waiting)."""
    replicas = ReplicaPool(ReplicaSpec(f"h:{i + 1}", model) for i, (model, _, _) in enumerate(loads))
    for replica, (_, runs, waits) in zip(replicas.replicas, loads):
        replicas.set_state(replica, SERVING)
        replica.load = Load(runs, waits)
    return replicas


def test_the_longest_runner_of_a_long_queue_moves_while_another_replica_is_idle() -> None:
    busy, idle, other = pool(("a", 2, 3), ("a", 0, 0), ("b", 0, 0)).replicas
    streams = {"new": (busy, 9.0), "old": (busy, 1.0), "elsewhere": (other, 0.5)}
    assert moves([busy, idle, other], streams, 2) == ["old"]
    assert moves([busy, idle, other], streams, 4) == [], "a queue of 3 is not long at 4"
    assert moves([busy, other], streams, 2) == [], "no idle replica of its model"
    idle.in_flight = 1  # the router just sent it something
    assert moves([busy, idle, other], streams, 2) == []
    idle.in_flight = 0
    idle.state = NOT_SERVING
    assert moves([busy, idle, other], streams, 2) == []


def test_a_rebalanced_replica_stays_in_the_serving_set() -> None:
    replicas = pool(("a", 2, 3), ("a", 0, 0))
    journey = Journey(replicas, lambda replica, request_id: None, "r")
    journey.handed_back(replicas.replicas[0], [pb.SequenceState(index=0)], draining=False)
    assert replicas.replicas[0].state == SERVING and journey.moved_from == [replicas.replicas[0]]


def test_an_engine_moves_only_the_requests_named_and_serves_on() -> None:
    async def main() -> None:
        engine = stand_in_engine()
        moved: list[int] = []

        def rebalance() -> None:  # Control.Migrate once both run
            live = engine.scheduler.requests.values()
            if len(live) == 2 and all(len(r.output_token_ids) >= 3 for r in live):
                engine.after_step = None
                moved.append(engine.migrate({"r0", "not-here"}))

        engine.after_step = rebalance
        async with running(engine):
            specs = [dataclasses.replace(spec(f"r{i}", 3, 20), migratable=True) for i in range(2)]
            handed, stayed = await asyncio.gather(*(collect(engine.submit(s)) for s in specs))
        assert moved == [1]
        assert handed[-1].finish_reason is FinishReason.MIGRATED and handed[-1].migrated is not None
        assert stayed[-1].finish_reason is FinishReason.LENGTH
        assert not engine.draining and not engine.takes_back("r0") and not engine.unavailable()

    asyncio.run(main())
