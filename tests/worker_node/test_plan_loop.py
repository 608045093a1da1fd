"""The worker's plan loop keeps an answer the socket would not take (zmq.Again) and sends it once it can: a dropped
StepResult would leave the scheduler waiting out its step deadline and declaring a healthy rank lost."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from proto.wire import Message, Shutdown, StepPlan, StepResult, decode, encode
from worker_node.plan_loop import PlanLoop

pytestmark = pytest.mark.unit


class BusySocket(zmq.Socket):  # type: ignore[type-arg]
    """A DEALER whose first StepResults find the socket full, as under a high-water mark or a reconnect."""

    refusals = 0  # StepResults still to refuse

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False, **kw: Any) -> Any:  # type: ignore[override]
        if self.refusals and isinstance(decode(bytes(data)), StepResult):
            self.refusals -= 1
            raise zmq.Again()
        return super().send(data, flags, copy=copy, track=track, **kw)


def _answer(plan: StepPlan) -> Message:
    return StepResult(plan.step_id, {1: [plan.step_id]})


def test_a_result_the_socket_would_not_take_is_sent_later_not_dropped() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER, socket_class=BusySocket)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.refusals = 3
    loop = PlanLoop(dealer, 0, _answer, initial_timeout=30.0)
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(loop.run()), daemon=True)
    thread.start()
    identity = _next_of(router, lambda m: True)[0]  # its first heartbeat: the connection is up
    try:
        for step_id in (1, 2):
            router.send_multipart([identity, encode(StepPlan(step_id))])
        results = [_next_of(router, lambda m: isinstance(m, StepResult))[1] for _ in range(2)]
        assert [r.step_id for r in results] == [1, 2], "every answer arrives, in order"
        assert dealer.refusals == 0
    finally:
        router.send_multipart([identity, encode(Shutdown("done"))])  # the loop owns the socket until it returns
        thread.join(10)
        dealer.close()
        router.close()
        ctx.term()
    assert exit_code == [0]


def _next_of(router: zmq.Socket, wanted: Any, timeout: float = 10.0) -> tuple[bytes, Any]:  # type: ignore[type-arg]
    """The next message from the worker that `wanted` accepts (others skipped), within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if router.poll(int(left * 1000)):
            identity, data = router.recv_multipart()
            message = decode(data)
            if wanted(message):
                return identity, message
    raise AssertionError(f"no such message from the worker within {timeout} s")
