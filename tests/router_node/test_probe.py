"""The router's prober takes back a replica whose DNS name comes back (a Kubernetes pod replaced in a rolling
upgrade): an unreachable replica gets a fresh channel every `reopen_after`, which resolves the name at once, instead
of waiting out gRPC's resolver backoff (tens of seconds); a replica that is only slow keeps its channel."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router_node.metrics import RouterMetrics
from router_node.probe import Prober
from router_node.replica import DOWN, SERVING, ReplicaPool, ReplicaSpec
from router_node.upstream import open_links
from tests.support.dns import LoopbackDns
from tests.support.waiting import until

pytestmark = pytest.mark.unit


class SlowHealth(health.aio.HealthServicer):
    """Answers every check after `delay` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def Check(self, request: health_pb2.HealthCheckRequest, context: object) -> health_pb2.HealthCheckResponse:  # noqa: N802
        await asyncio.sleep(self.delay)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _server(servicer: health.aio.HealthServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _prober(address: str, timeout: float) -> Prober:
    pool = ReplicaPool([ReplicaSpec(address, "m")])
    return Prober(pool, open_links(pool), RouterMetrics(), interval=0.05, timeout=timeout, reopen_after=0.3)


def test_a_replica_whose_name_comes_back_is_served_again_through_a_fresh_channel() -> None:
    async def scenario(dns: LoopbackDns) -> None:
        server, port = await _server(health.aio.HealthServicer())
        prober = _prober(dns.target("replica-0.replica", port), timeout=1.0)
        replica, address = prober.pool.replicas[0], dns.target("replica-0.replica", port)
        first = prober.links[address]
        task = asyncio.ensure_future(prober.run())
        try:
            await until(lambda: replica.state == DOWN, 10, "DOWN while its name does not resolve")
            await until(lambda: prober.links[address] is not first, 10, "a fresh channel while it is unreachable")
            dns.up = True  # the new pod is there under the old name
            await until(lambda: replica.state == SERVING, 10, "SERVING once its name resolves")
        finally:
            task.cancel()
            await server.stop(None)

    with LoopbackDns() as dns:
        asyncio.run(scenario(dns))


def test_a_replica_that_answers_too_slowly_keeps_its_channel() -> None:
    async def scenario() -> None:
        server, port = await _server(SlowHealth(delay=0.5))
        prober = _prober(f"127.0.0.1:{port}", timeout=0.1)
        link, replica = prober.links[f"127.0.0.1:{port}"], prober.pool.replicas[0]
        try:
            for _ in range(8):  # 8 x 0.1 s past reopen_after: DEADLINE_EXCEEDED each time, never UNAVAILABLE
                await prober.probe(replica)
                assert replica.state == DOWN
            assert prober.links[f"127.0.0.1:{port}"] is link, "a channel with live streams was replaced"
        finally:
            await server.stop(None)

    asyncio.run(scenario())
