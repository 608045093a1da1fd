"""The worker's plan loop keeps an answer the socket would not take (zmq.Again) and sends it once it can: a dropped
StepResult would leave the scheduler waiting out its step deadline and declaring a healthy rank lost. A flood of
malformed messages is counted and costs the log a line or two, not one line each."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import zmq

from proto.wire import Message, Shutdown, StepPlan, StepResult, WorkerHello, decode, encode
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


FLOOD = 20_000


def test_a_flood_of_malformed_messages_is_counted_in_a_few_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 45: one warning per malformed message let a flood fill the disk. 20,000 of them (random garbage and
    messages of kinds a worker never takes) are each counted, logged in a line or two, and the worker still answers
    the plan that follows them."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)  # the whole flood queues (a ROUTER drops at its high-water mark): all arrive
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    loop = PlanLoop(dealer, 0, _answer, initial_timeout=30.0)
    thread = threading.Thread(target=loop.run, daemon=True)
    identity = b""
    try:
        with caplog.at_level(logging.WARNING, "worker_node.plan_loop"):
            thread.start()
            identity = _next_of(router, lambda m: True)[0]
            garbage = [b"\xc1", encode(WorkerHello("h", 1, "cpu")), bytes(range(40)), b""]
            for i in range(FLOOD):
                router.send_multipart([identity, garbage[i % len(garbage)]])
            router.send_multipart([identity, encode(StepPlan(1))])
            assert _next_of(router, lambda m: isinstance(m, StepResult))[1].step_id == 1, "it still serves"
        logged = [r for r in caplog.records if r.name == "worker_node.plan_loop"]
        assert len(logged) <= 2, f"{len(logged)} lines for {FLOOD} malformed messages"
        assert loop.drops.total == FLOOD
    finally:
        if identity:
            router.send_multipart([identity, encode(Shutdown("done"))])
        thread.join(10)
        dealer.close()
        router.close()
        ctx.term()
