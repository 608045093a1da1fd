"""The scheduler's gRPC port names the workers' socket (scheduler_node/cli/join_door.py), and a worker that asks
there (worker_node/join_address.py, bare HTTP/2) is told it; a wildcard bind address becomes the host it asked."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_node.cli.join_door import start_join_door
from scheduler_node.engine.ports import free_port
from worker_node.join_address import join_address

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("bound", "told"), [("127.0.0.1:50061", "127.0.0.1:50061"), ("0.0.0.0:6000", "127.0.0.1:6000")]
)
def test_a_worker_asking_the_grpc_port_is_told_where_workers_join(bound: str, told: str) -> None:
    async def scenario() -> str:
        port = free_port()
        door = await start_join_door(f"127.0.0.1:{port}", bound)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, join_address, f"127.0.0.1:{port}", 10.0)
        finally:
            await door.stop(None)

    assert asyncio.run(scenario()) == told


def test_meanwhile_health_says_not_serving() -> None:
    async def scenario() -> int:
        port = free_port()
        door = await start_join_door(f"127.0.0.1:{port}", "127.0.0.1:50061")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return int(reply.status)
        finally:
            await door.stop(None)

    assert asyncio.run(scenario()) == health_pb2.HealthCheckResponse.NOT_SERVING
