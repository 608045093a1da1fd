"""The scheduler's live requests: by id, by handle, and in which queue (waiting, running).

Both queues are kept in the policy's order when it is stable (the order of two requests never changes), so no step
sorts them; else in arrival. A request's handle is its name on the wire, never reused: a late result of a plan in
flight names no one else.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

from scheduler_node.core.policy import Policy
from scheduler_node.core.request import Request, Status


class RequestQueues:
    def __init__(self, policy: Policy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self.requests: dict[str, Request] = {}
        # Read by the hot paths (a plan's and a result's requests by handle): written here only.
        self.by_handle: dict[int, Request] = {}
        self._handles = itertools.count()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Running requests that may have more than one token to compute (admitted, or rolled back by an
        # interrupt): the only ones whose prefill can set the floor. Dropped once they caught up.
        self._catching_up: set[Request] = set()

    def check_new(self, reqs: list[Request]) -> None:
        for r in reqs:
            if r.req_id in self.requests:
                raise KeyError(f"request {r.req_id!r} is already live")

    def register(self, req: Request) -> None:
        """A new live request, with its handle (it is in no queue yet)."""
        req.handle = next(self._handles)
        self.requests[req.req_id] = req
        self.by_handle[req.handle] = req

    def remove(self, req_id: str) -> Request | None:
        """A request leaves: out of the index and its queue (a finished one still sits in running)."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        del self.by_handle[req.handle]
        if req.status is Status.RUNNING or req.finished:
            self.running.remove(req)
            self._catching_up.discard(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        return req

    def request_of(self, handle: int) -> Request | None:
        return self.by_handle.get(handle)

    def is_live(self, req: Request) -> bool:
        return self.by_handle.get(req.handle) is req

    def enqueue(self, req: Request) -> None:
        """Into waiting: in its place under a stable policy order, else at the end."""
        if self.policy.stable_order:
            now = self.clock()
            bisect.insort(self.waiting, req, key=lambda r: self.policy.sort_key(r, now))
        else:
            self.waiting.append(req)

    def start_running(self, req: Request) -> None:
        self.waiting.remove(req)
        if self.policy.stable_order:
            now = self.clock()
            bisect.insort(self.running, req, key=lambda r: self.policy.sort_key(r, now))
        else:
            self.running.append(req)
        req.status = Status.RUNNING
        self._catching_up.add(req)

    def stop_running(self, req: Request) -> None:
        """Out of running (preempted): back into waiting is the caller's next step."""
        self.running.remove(req)
        self._catching_up.discard(req)

    def take_running(self) -> list[Request]:
        """Every running request leaves running (the workers' KV is gone)."""
        running, self.running = self.running, []
        self._catching_up.clear()
        return running

    def catching_up(self, req: Request) -> None:
        """It may have more than one token to compute again (an interrupt rolled it back)."""
        self._catching_up.add(req)

    def catching_up_pending(self, held: Callable[[int], bool]) -> list[Request]:
        """The running requests with prompt tokens left to compute that no plan in flight holds; those that caught
        up are dropped for good (only an interrupt's rollback brings one back)."""
        pending = []
        for req in list(self._catching_up):
            if req.status is not Status.RUNNING or req.tokens_to_schedule() <= 1:
                self._catching_up.discard(req)
            elif not held(req.handle):
                pending.append(req)
        return pending

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
