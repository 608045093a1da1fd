"""The collector's schedule: what it freezes is out of automatic collections, and comes back at idle."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from scheduler_node.engine.collector import YOUNG_THRESHOLD, CollectorSchedule
from scheduler_node.engine.core import EngineOptions
from tests.support.stand_in import running, spec, stand_in_engine
from tests.support.waiting import until

pytestmark = pytest.mark.unit


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def garbage_cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_gc")
def test_frozen_cycles_wait_for_the_idle_collection() -> None:
    now = [0.0]
    schedule = CollectorSchedule(full_interval_s=60.0, clock=lambda: now[0])
    schedule.start()
    assert gc.get_threshold()[0] >= YOUNG_THRESHOLD and gc.get_freeze_count() > 0
    alive = garbage_cycle()
    schedule.admitted()  # frozen with what a step admitted
    gc.collect()
    assert alive() is not None, "a frozen cycle is out of the collector's walks"
    schedule.idle()
    assert alive() is None


@pytest.mark.usefixtures("restored_gc")
def test_a_load_that_never_idles_gets_a_full_collection_per_interval() -> None:
    now = [0.0]
    schedule = CollectorSchedule(full_interval_s=60.0, clock=lambda: now[0])
    schedule.start()
    alive = garbage_cycle()
    now[0] = 59.0
    schedule.admitted()
    assert schedule.full_collections == 1 and alive() is not None
    now[0] = 60.0
    schedule.admitted()
    assert schedule.full_collections == 2 and alive() is None


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="full_interval_s"):
        CollectorSchedule(full_interval_s=0)


def test_the_idle_collection_waits_until_the_engine_has_been_idle_a_while() -> None:
    """A client that sends requests one after another finds the engine idle each time: a full collection run the
    moment each request ends would be the next one's wait (tens of ms). It runs once the idle period lasts."""
    delay = 0.5

    async def scenario() -> tuple[int, int, int]:
        engine = stand_in_engine(EngineOptions(schedule_gc=True, idle_collection_delay_s=delay))
        collector = engine.collector
        assert collector is not None
        try:
            async with running(engine):
                await until(lambda: collector.full_collections == 1, 10, "the start-up collection")
                at_start = collector.full_collections
                for i in range(3):
                    async for _ in engine.submit(spec(f"r{i}", 20, 4)):
                        pass
                    await asyncio.sleep(0.05)  # the scenario: a client's round trip (50 ms) before its next request
                back_to_back = collector.full_collections
                await until(lambda: collector.full_collections > back_to_back, 30 * delay, "the idle collection")
                await asyncio.sleep(2 * delay)  # the scenario: idle on for two more delays, which collect nothing
                return at_start, back_to_back, collector.full_collections
        finally:
            gc.unfreeze()

    threshold = gc.get_threshold()
    try:
        at_start, back_to_back, after_idle = asyncio.run(scenario())
    finally:
        gc.set_threshold(*threshold)
    assert back_to_back == at_start, "no full collection between requests sent back to back"
    assert after_idle == at_start + 1, "one full collection once the engine stayed idle"
