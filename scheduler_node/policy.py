"""Scheduling policies decide order and victims; the scheduler applies the one rule under their order."""

from __future__ import annotations

from typing import Any, Iterable

from scheduler_node.request import Request


class Policy:
    """Base class: first come, first served. Subclass and override `sort_key` (or the methods) to customise."""

    name = "fcfs"

    def sort_key(self, req: Request) -> Any:
        return (req.arrival_time, req.arrival_seq)

    def order_waiting(self, waiting: Iterable[Request]) -> list[Request]:
        return sorted(waiting, key=self.sort_key)

    def order_running(self, running: Iterable[Request]) -> list[Request]:
        return sorted(running, key=self.sort_key)

    def pick_victim(self, candidates: list[Request]) -> Request | None:
        """The running request to preempt when memory runs out: the one this policy values least."""
        return max(candidates, key=self.sort_key, default=None)


POLICIES: dict[str, type[Policy]] = {"fcfs": Policy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
