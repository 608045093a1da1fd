"""A replica's KV event publisher (scheduler_node/engine/kv_publisher.py) over a real engine core with stand-in
workers, into the router's real subscriber over loopback ZeroMQ: the router's index equals the replica's prefix
cache, and a restarted replica (a new publisher, a new epoch, on the same ports) is resynchronized to its empty
cache, never trusted stale. Junk on either side is counted and logged at a bounded rate."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from minivllm.cluster import free_port
from proto.kv_events import SNAPSHOT_REQUEST, decode_snapshot, encode_batch
from router_node.kv_index import KVIndex
from router_node.kv_subscriber import KVSubscriber
from router_node.metrics import RouterMetrics
from router_node.replica import SERVING, ReplicaPool
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv.prefix_events import KVEventSink
from scheduler_node.engine.kv_publisher import KVEventPublisher
from settings.router import parse_replica
from tests.support.stand_in import StandInRun, spec
from tests.support.waiting import until

pytestmark = pytest.mark.unit


def test_a_publisher_feeds_the_subscriber_and_a_restart_is_never_trusted_stale() -> None:
    asyncio.run(_publish_and_restart())


async def _publish_and_restart() -> None:
    port, snap = free_port(), free_port()
    pool = ReplicaPool([parse_replica(f"h:1,model=m,kv_events=127.0.0.1:{port},kv_snapshot=127.0.0.1:{snap}")])
    replica = pool.replicas[0]
    pool.set_state(replica, SERVING)
    index = KVIndex()
    subscriber = KVSubscriber(pool, index)
    feed = subscriber.feeds[replica.address]
    follow = asyncio.ensure_future(subscriber.run())
    run, publishing = await _replica(port, snap)
    try:
        run.submit(spec("r1", prompt_len=64, max_tokens=2))
        await run.until_idle()
        cached = set(run.engine.scheduler.blocks._cached)
        assert len(cached) >= 4
        await until(lambda: feed.synced and index.owned.get(replica.address) == cached, 10, "the index follows")
        epoch = feed.epoch
        publishing.cancel()  # the replica restarts: a new process, a new epoch, an empty cache
        await run.stop()
        run, publishing = await _replica(port, snap)
        await until(lambda: feed.epoch not in (None, epoch) and feed.synced, 15, "a snapshot of the new epoch")
        assert index.num_blocks(replica.address) == 0 and feed.resyncs == 1
    finally:
        publishing.cancel()
        await run.stop()
        follow.cancel()
        await asyncio.gather(follow, publishing, return_exceptions=True)


async def _replica(port: int, snapshot_port: int) -> tuple[StandInRun, asyncio.Future[None]]:
    run = StandInRun.build(SchedulerConfig(block_size=16, max_num_batched_tokens=64, max_num_seqs=4), 32)
    sink = KVEventSink()
    run.engine.scheduler.attach_kv_events(sink)
    publisher = KVEventPublisher(sink, 16, "127.0.0.1", port, snapshot_port)
    run.engine.after_step = publisher.publish
    run.start()
    return run, asyncio.ensure_future(publisher.run())


FLOOD = 5_000


def test_junk_on_either_side_is_counted_in_a_few_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 45: a request that is not `snapshot` on the publisher's port, and a batch the router cannot read, are
    each counted (the router's in Prometheus) and logged a line or two per flood; the publisher still answers."""
    with caplog.at_level(logging.WARNING, "scheduler_node"):
        asyncio.run(_junk_requests(caplog))
        metrics = RouterMetrics()
        pool = ReplicaPool([parse_replica("h:1,model=m,kv_events=127.0.0.1:1,kv_snapshot=127.0.0.1:2")])
        subscriber = KVSubscriber(pool, KVIndex(), metrics)
        feed = subscriber.feeds[pool.replicas[0].address]
        for i in range(FLOOD):
            subscriber._on_message(feed, b"\xc1" if i % 2 else encode_batch(b"e" * 8, 0, 16, []))  # seq 0: refused
    logged = [r for r in caplog.records if r.name == "router_node.kv_subscriber"]
    assert len(logged) <= 2 and subscriber.drops.total == FLOOD
    assert (
        f'minivllm:dropped_messages_total{{socket="kv_events"}} {float(FLOOD)}'
        in generate_latest(metrics.registry).decode()
    )


async def _junk_requests(caplog: pytest.LogCaptureFixture) -> None:
    publisher = KVEventPublisher(KVEventSink(), 16, "127.0.0.1", free_port(), free_port())
    running = asyncio.ensure_future(publisher.run())
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(f"tcp://{publisher.snapshot_address}")
    try:
        for i in range(FLOOD):
            await sock.send_multipart([b"snapshot!"] if i % 2 else [b"snap", b"shot"])
        await sock.send(SNAPSHOT_REQUEST)
        assert await sock.poll(30_000), "the publisher still answers a snapshot request"
        assert decode_snapshot(await sock.recv()).entries == []
        logged = [r for r in caplog.records if r.name == "scheduler_node.engine.kv_publisher"]
        assert len(logged) <= 2 and publisher.drops.total == FLOOD
    finally:
        sock.close()
        ctx.term()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
