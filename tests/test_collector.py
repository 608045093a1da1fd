"""The collector's schedule: what it freezes is out of automatic collections, and comes back at idle."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from scheduler_node.engine.collector import YOUNG_THRESHOLD, CollectorSchedule


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
