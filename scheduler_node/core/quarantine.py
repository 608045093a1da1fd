"""Requests under suspicion: a step failed and no worker could say whose fault it was.

A worker that knows whose inputs failed a step says so (StepError.handles): those requests fail alone. When it
cannot tell (any other exception), failing the whole step would fail every innocent request in it, so instead its
requests become suspects: each runs alone, in a step of its own, until it has sampled a token; the other requests
run as usual in the steps between. A suspect that fails alone is the culprit, and the engine fails it
(scheduler_node/engine/failures.py); the innocent leave quarantine having lost only time. A failure that depends on
the batch rather than on a request (its size, its mix) also passes once its requests run apart.

Steps alternate: a normal step (everyone but the suspects), then one suspect's step, round robin. A turn whose
step comes out empty (its requests wait for plans in flight, or for blocks) gives way to the next turn at once
(`next_turn`), so the engine never waits on a turn that has nothing to run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from scheduler_node.core.request import Request


class Quarantine:
    def __init__(self) -> None:
        self._suspects: dict[str, None] = {}  # in the order they run alone
        self._turn = -1  # -1: the normal step; i >= 0: the i-th suspect's step
        self._empty_turns = 0  # turns in a row whose step came out empty

    @property
    def active(self) -> bool:
        return bool(self._suspects)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._suspects

    def add(self, req_ids: Iterable[str]) -> None:
        """The requests of a step that failed with nobody blamed."""
        for req_id in req_ids:
            self._suspects[req_id] = None

    def release(self, req_id: str) -> None:
        """The request has sampled alone (innocent), or it ended."""
        self._suspects.pop(req_id, None)
        if self._turn >= len(self._suspects):
            self._turn = -1

    def excluded(self) -> Callable[[Request], bool] | None:
        """Which requests this step leaves out (None: no one): the suspects in a normal step, everyone else in a
        suspect's step."""
        if not self._suspects:
            return None
        if self._turn < 0:
            suspects = self._suspects
            return lambda req: req.req_id in suspects
        alone = self.alone
        return lambda req: req.req_id != alone

    @property
    def alone(self) -> str | None:
        """The suspect this step runs alone (None: a normal step)."""
        if self._turn < 0 or not self._suspects:
            return None
        return list(self._suspects)[self._turn]

    def planned(self, has_work: bool) -> bool:
        """The turn's plan is built: the next turn's step comes next. Returns whether the engine should build
        another plan at once, because this one came out empty and some turn has not been tried since the last
        plan that had work."""
        if not self._suspects:
            self._turn, self._empty_turns = -1, 0
            return False
        self._turn = self._turn + 1 if self._turn + 1 < len(self._suspects) else -1
        if has_work:
            self._empty_turns = 0
            return False
        self._empty_turns += 1
        if self._empty_turns > len(self._suspects):  # every turn came out empty: wait for results
            self._empty_turns = 0
            return False
        return True
