"""Each replica probed every interval: grpc.health.v1 says whether it serves (unreachable: down), then its
Control.GetStats gives the load `least_loaded` reads, and its Control.ListLoraAdapters the LoRA adapters it serves.
A dead replica leaves the routing within one interval plus the probe's timeout (or at once, when a stream to it
fails); it comes back on its first SERVING answer.

A replica unreachable (UNAVAILABLE) for REOPEN_AFTER_S gets a fresh channel, again every REOPEN_AFTER_S while it
stays so: a channel whose DNS name stopped resolving (a Kubernetes pod being replaced: its name is gone until the
new pod exists) retries the resolution with gRPC's own backoff, growing to 2 min, so a replica back under its name
would be seen tens of seconds late, after a rolling upgrade had moved on to drain the next one. A fresh channel
resolves at its first call."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2

from proto import serving_pb2 as pb
from router_node.metrics import RouterMetrics
from router_node.replica import DOWN, NOT_SERVING, SERVING, Load, Replica, ReplicaPool
from router_node.upstream import Link, open_link
from scheduler_node.api.health import set_serving

logger = logging.getLogger(__name__)

REFRESH_GAP_S = 0.5
# Longer than a scheduler's gRPC shutdown grace (2 s): the old channel is closed, and no stream may be left on it.
REOPEN_AFTER_S = 3.0


class Prober:
    def __init__(
        self,
        pool: ReplicaPool,
        links: dict[str, Link],
        metrics: RouterMetrics,
        interval: float,
        timeout: float,
        control_token: str = "",
        reopen_after: float = REOPEN_AFTER_S,
    ) -> None:
        self.pool = pool
        self.reopen_after = reopen_after
        self.links = links
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {control_token}")] if control_token else []
        self._stats_refused: set[str] = set()  # replicas whose GetStats said no (logged once)
        self._refresh_lock = asyncio.Lock()
        self._refreshed = -math.inf
        self._unreachable: dict[str, float] = {}  # replica address -> since when (or its last reopen) UNAVAILABLE

    async def run(self) -> None:
        await asyncio.gather(*(self._watch(r) for r in self.pool.replicas))

    async def _watch(self, replica: Replica) -> None:
        while True:
            try:
                await self.probe(replica)
            except Exception as exc:  # whatever went wrong, keep probing this replica (and the others)
                logger.exception("probing %s failed", replica.address)
                self.pool.set_state(replica, DOWN, repr(exc))
            self.metrics.healthy.labels(replica.model, replica.address).set(1 if replica.state == SERVING else 0)
            await asyncio.sleep(self.interval)

    async def probe(self, replica: Replica) -> None:
        link = self.links[replica.address]
        try:
            answer = await link.health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            self.pool.set_state(replica, DOWN, f"{exc.code().name}: {exc.details()}")
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._reopen_if_unreachable(replica)
            else:  # DEADLINE_EXCEEDED: connected but slow; its streams may live on this channel
                self._unreachable.pop(replica.address, None)
            return
        self._unreachable.pop(replica.address, None)
        if answer.status != health_pb2.HealthCheckResponse.SERVING:
            self.pool.set_state(replica, NOT_SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
            return
        self.pool.set_state(replica, SERVING)
        try:
            stats = await link.control.GetStats(pb.GetStatsRequest(), timeout=self.timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                if replica.address not in self._stats_refused:
                    self._stats_refused.add(replica.address)
                    why = f"replica {replica.address} refused GetStats ({exc.details()}); set --replica-control-token"
                    logger.warning("%s; least_loaded counts only the router's own streams on it", why)
            return
        replica.load = Load(
            stats.num_running, stats.num_waiting, stats.kv_usage, stats.max_model_len, replica.in_flight
        )
        await self.learn_adapters(replica)

    async def _reopen_if_unreachable(self, replica: Replica) -> None:
        now = time.monotonic()
        since = self._unreachable.setdefault(replica.address, now)
        if now - since < self.reopen_after:
            return
        old = self.links[replica.address]
        self.links[replica.address] = open_link(replica.address)  # every caller looks the link up per call
        self._unreachable[replica.address] = now
        logger.debug("replica %s unreachable for %.1f s: a fresh channel", replica.address, now - since)
        await old.channel.close()

    async def learn_adapters(self, replica: Replica) -> None:
        """The LoRA adapters `replica` serves now (none from a replica without LoRA, or one that refuses)."""
        try:
            answer = await self.links[replica.address].control.ListLoraAdapters(
                pb.ListLoraAdaptersRequest(), timeout=self.timeout, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:  # UNIMPLEMENTED: an older scheduler; UNAUTHENTICATED: logged above
            logger.debug("replica %s: no LoRA adapter list (%s)", replica.address, exc.code().name)
            return
        adapters = frozenset(a.name for a in answer.adapters)
        if adapters != replica.adapters:
            logger.info("replica %s (%s) serves LoRA adapters: %s", replica.address, replica.model,
                        ", ".join(sorted(adapters)) or "none")  # fmt: skip
            replica.adapters = adapters

    async def refresh_adapters(self) -> None:
        """Ask every serving replica at once (a request named an adapter no replica served at the last probe);
        requests that ask meanwhile share the answer, and unknown names asked in a stream cost one round at most
        every REFRESH_GAP_S."""
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed < REFRESH_GAP_S:
                return
            await asyncio.gather(*(self.learn_adapters(r) for r in self.pool.serving()))
            self._refreshed = time.monotonic()


async def report_health(
    pool: ReplicaPool, health_service: health.aio.HealthServicer, draining: Callable[[], bool]
) -> None:
    """The router is SERVING while every model it routes has a serving replica and it is not draining (a drain
    sets `pool.changed` too)."""
    serving: bool | None = None
    while True:
        pool.changed.clear()
        now = pool.every_model_served and not draining()
        if now != serving:
            await set_serving(health_service, now)
            logger.info("health: %s", "SERVING" if now else "NOT_SERVING")
            serving = now
        await pool.changed.wait()
