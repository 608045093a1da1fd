"""grpc.health.v1: the server ("") is SERVING exactly while every rank is ready and the engine takes requests;
`minivllm.liveness` is SERVING while the scheduler answers at all (waiting for workers, serving or draining), for
liveness probes that must not restart a scheduler whose workers are away."""

from __future__ import annotations

import logging

from grpc_health.v1 import health, health_pb2

from scheduler_node.api.grpc_server import SERVICE_NAMES
from scheduler_node.engine.core import EngineCore

logger = logging.getLogger(__name__)

LIVENESS = "minivllm.liveness"


async def set_serving(health_service: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAMES[0]):
        await health_service.set(name, status)
    await health_service.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)


async def report_health(engine: EngineCore, health_service: health.aio.HealthServicer) -> None:
    """Keep grpc.health.v1 at SERVING exactly while every rank is ready and the engine takes requests."""
    serving: bool | None = None
    while True:
        engine.workers.changed.clear()
        now = engine.workers.all_ready and not engine.unavailable()
        if now != serving:
            await set_serving(health_service, now)
            logger.info("health: %s", "SERVING" if now else "NOT_SERVING")
            serving = now
        await engine.workers.changed.wait()
