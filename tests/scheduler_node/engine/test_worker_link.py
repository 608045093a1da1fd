"""The scheduler's worker socket (scheduler_node/engine/worker_link.py) under a flood, as anyone who reaches the port
can send one without CURVE (issue 45): every malformed or unexpected message is counted, in Prometheus too, the log
grows by a line or two instead of one line each, and a worker that says Hello after the flood still joins."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
from prometheus_client import generate_latest

from proto.wire import Assignment, StepPlan, WorkerHello, WorkerReady, decode, encode
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.ports import free_port
from scheduler_node.engine.worker_link import WorkerLink
from tests.support.waiting import until

pytestmark = pytest.mark.unit

FLOOD = 20_000
# Garbage, a frame of the wrong shape, and well-formed messages no worker may send unasked: each one a drop.
GARBAGE = [[b"\xc1"], [bytes(range(40))], [b"a", b"b"], [encode(StepPlan(1))], [encode(WorkerReady(0, 9, 9))]]


def assignment(rank: int) -> Assignment:
    return Assignment(rank, 1, "/models/x", "auto", 16, 2048, 128)


def test_a_flood_of_malformed_messages_is_counted_in_a_few_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "scheduler_node.engine"):
        asyncio.run(_flood(caplog))


async def _flood(caplog: pytest.LogCaptureFixture) -> None:
    link = WorkerLink(f"127.0.0.1:{free_port()}")
    metrics = Metrics("m")
    metrics.count_drops(link.drops)
    joining = asyncio.ensure_future(link.start(assignment, 60.0))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # the whole flood queues: the Hello behind it arrives
    sock.connect(f"tcp://{link.address}")
    try:
        for i in range(FLOOD):
            sock.send_multipart(GARBAGE[i % len(GARBAGE)])
        sock.send(encode(WorkerHello("h", 1, "cpu")))
        await until(lambda: sock.poll(0), 30, "an answer to the Hello after the flood")
        assert isinstance(decode(sock.recv()), Assignment), "the scheduler still serves"
        logged = [r for r in caplog.records if r.name.startswith("scheduler_node.engine")]
        assert len(logged) <= 2, f"{len(logged)} lines for {FLOOD} malformed messages"
        assert link.drops.total == FLOOD
        sample = f'minivllm:dropped_messages_total{{model_name="m",socket="workers"}} {float(FLOOD)}'
        assert sample in generate_latest(metrics.registry).decode()
    finally:
        sock.close()
        ctx.term()
        joining.cancel()
        await asyncio.gather(joining, return_exceptions=True)
        await link.close("done")
