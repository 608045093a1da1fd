"""The router's side of the replicas' KV events (`--routing-strategy kv`): one ZeroMQ SUB per replica that
publishes them (its `kv_events=HOST:PORT` in --replica), feeding the index (router_node/kv_index.py), and
a snapshot request (DEALER to its `kv_snapshot` address) whenever the replica's part cannot be trusted.

A replica that the prober does not see serving, or that sent nothing for SILENCE_S (it sends a heartbeat every
second), counts as holding nothing until it is heard again and a snapshot resynchronized it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from proto.drop_log import DropLog
from proto.kv_events import MAX_KV_MESSAGE_BYTES, SNAPSHOT_REQUEST, KVWireError, decode_batch, decode_snapshot
from router_node.kv_index import KVIndex, ReplicaFeed
from router_node.metrics import RouterMetrics
from router_node.replica import SERVING, Replica, ReplicaPool

logger = logging.getLogger(__name__)

POLL_S = 0.25
SILENCE_S = 5.0  # a replica heard from less recently than this (5 heartbeats missed) is not trusted
SNAPSHOT_TIMEOUT_S = 5.0
SNAPSHOT_RETRY_S = 1.0


class KVSubscriber:
    def __init__(self, pool: ReplicaPool, index: KVIndex, metrics: RouterMetrics | None = None) -> None:
        self.index = index
        self.metrics = metrics
        self.replicas = [r for r in pool.replicas if r.spec.kv_events]
        self.feeds = {r.address: ReplicaFeed(r.address, index) for r in self.replicas}
        # Batches and snapshots it could not read: counted, logged at a bounded rate (proto/drop_log.py).
        self.drops = DropLog("kv_events", logger)
        if metrics is not None:
            metrics.count_drops(self.drops)
        self._ctx = zmq.asyncio.Context()

    async def run(self) -> None:
        try:
            await asyncio.gather(*(self._follow(r) for r in self.replicas))
        finally:
            self.drops.flush()
            self._ctx.destroy(linger=0)

    async def _follow(self, replica: Replica) -> None:
        feed = self.feeds[replica.address]
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_KV_MESSAGE_BYTES)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{replica.spec.kv_events}")
        heard = float("-inf")
        snapshot: asyncio.Future[None] | None = None
        next_try = 0.0
        try:
            while True:
                if await sub.poll(POLL_S * 1000):
                    heard = time.monotonic()
                    self._on_message(feed, await sub.recv())
                now = time.monotonic()
                if replica.state != SERVING or now - heard > SILENCE_S:
                    if feed.synced:
                        why = "not serving" if replica.state != SERVING else f"silent for {SILENCE_S:g} s"
                        logger.warning("KV index of %s dropped: %s", replica.address, why)
                        feed.distrust()
                elif not feed.synced and (snapshot is None or snapshot.done()) and now >= next_try:
                    snapshot = asyncio.ensure_future(self._snapshot(replica, feed))
                    next_try = now + SNAPSHOT_RETRY_S
                if self.metrics is not None:
                    self.metrics.kv_blocks.labels(replica.model, replica.address).set(
                        self.index.num_blocks(replica.address)
                    )
        finally:
            if snapshot is not None:
                snapshot.cancel()
            sub.close(0)

    def _on_message(self, feed: ReplicaFeed, data: bytes) -> None:
        try:
            batch = decode_batch(data)
        except KVWireError as exc:
            self.drops.drop("KV events of %s: %s; resynchronizing", feed.name, exc)
            feed.distrust()
            return
        was_synced = feed.synced
        feed.on_batch(batch)
        if was_synced and not feed.synced:
            logger.info("KV index of %s dropped: a lost batch or a restart (epoch %s, seq %d); resynchronizing",
                        feed.name, batch.epoch.hex(), batch.seq)  # fmt: skip

    async def _snapshot(self, replica: Replica, feed: ReplicaFeed) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_KV_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{replica.spec.kv_snapshot}")
        try:
            await sock.send(SNAPSHOT_REQUEST)
            if not await sock.poll(SNAPSHOT_TIMEOUT_S * 1000):
                logger.warning("KV events: %s did not answer a snapshot request in %g s", replica.address,
                               SNAPSHOT_TIMEOUT_S)  # fmt: skip
                return
            snapshot = decode_snapshot(await sock.recv())
            feed.on_snapshot(snapshot)
            logger.info("KV index of %s: snapshot of %d blocks at seq %d", replica.address, len(snapshot.entries),
                        snapshot.seq)  # fmt: skip
        except KVWireError as exc:
            self.drops.drop("KV snapshot of %s: %s", replica.address, exc)
        finally:
            sock.close(0)
