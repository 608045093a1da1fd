"""`vllm-router --rebalance` (issue 31, off by default): long runners move off a replica whose queue is long to an
idle one, by the live migration a drain uses. Every probe interval, for each model: a serving replica with at least
`min_waiting` requests waiting while another of its model serves with nothing running or waiting gives up its
longest-running stream that came through this router (one a round): `Control.Migrate` ends it there with its
state, and the router resumes it elsewhere as it does a drained replica's (router/migration.py), except that the
replica stays in the serving set. Only gRPC streams are moved (an HTTP request's id is the replica's own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from proto import serving_pb2 as pb
from router_node.replica import SERVING, Replica
from router_node.upstream import Forwarder

logger = logging.getLogger(__name__)

MIN_WAITING = 2  # a queue this long (or longer) is long


def moves(replicas: Sequence[Replica], streams: dict[str, tuple[Replica, float]], min_waiting: int) -> list[str]:
    """The request ids to move now: per model, the longest-running stream of each replica whose queue is long, while
    an idle replica of that model serves."""
    chosen = []
    for busy in replicas:
        if busy.state != SERVING or busy.load.num_waiting < min_waiting:
            continue
        idle = [r for r in replicas if r.model == busy.model and r.state == SERVING and r is not busy]
        if not any(r.load.num_running == 0 and r.load.num_waiting == 0 and r.in_flight == 0 for r in idle):
            continue
        mine = [(started, request_id) for request_id, (r, started) in streams.items() if r is busy]
        if mine:
            chosen.append(min(mine)[1])
    return chosen


class Rebalancer:
    def __init__(self, forwarder: Forwarder, interval: float, timeout: float, control_token: str = "") -> None:
        self.forwarder = forwarder
        self.interval = interval
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {control_token}")] if control_token else []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for request_id in moves(self.forwarder.router.pool.replicas, self.forwarder.streams, MIN_WAITING):
                await self.move(request_id)

    async def move(self, request_id: str) -> None:
        """Ask the replica running `request_id` to hand it back (it resumes elsewhere)."""
        replica, _ = self.forwarder.streams[request_id]
        self.forwarder.rebalancing.add(request_id)
        try:
            answer = await self.forwarder.links[replica.address].control.Migrate(
                pb.MigrateRequest(request_ids=[request_id]), timeout=self.timeout, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("rebalance: %s did not move %s: %s", replica.address, request_id, exc.details())
            answer = pb.MigrateResponse()
        if answer.migrated:
            logger.info("rebalance: moving %s off %s (its queue is long)", request_id, replica.address)
        else:  # it ended meanwhile, or that replica cannot move it
            self.forwarder.rebalancing.discard(request_id)
