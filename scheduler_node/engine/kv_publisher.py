"""A replica's KV events on ZeroMQ (`--kv-events-port`): what its prefix cache gained and lost, for the router's
`kv` strategy (router_node/kv_index.py).

- **PUB** on `--kv-events-host:--kv-events-port`: one batch per engine step that changed the cache (several when
  a step's events exceed MAX_EVENTS_PER_BATCH), and an empty one every HEARTBEAT_S while nothing changes, so a
  subscriber notices a restarted replica (new epoch) or a lost message (a hole in `seq`) within a second.
- **ROUTER** on `--kv-events-snapshot-port` (default: the events port + 1): a peer that sends `snapshot` gets
  every (tier, hash) held after the last batch, with that batch's `seq`. A subscriber that starts late, sees a
  hole or a new epoch drops what it knew of this replica and asks for one.

It runs in the engine's event loop, the only code that changes the block table, so a snapshot and the batches
around it are consistent. Messages are msgpack (proto/kv_events.py). Loopback by default: the events name the
prompts' block hashes, which say which prompts were seen; open the port wider only towards the router.
"""

from __future__ import annotations

import logging
import os
import time

import zmq
import zmq.asyncio

from proto.drop_log import DropLog
from proto.kv_events import MAX_EVENTS_PER_BATCH, SNAPSHOT_REQUEST, encode_batch, encode_snapshot
from scheduler_node.core.kv.prefix_events import KVEventSink

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
SNDHWM = 100_000  # batches a slow subscriber may lag before PUB drops (it sees the hole and takes a snapshot)


class KVEventPublisher:
    def __init__(self, sink: KVEventSink, block_size: int, host: str, port: int, snapshot_port: int = 0) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"--kv-events-port must be in [1, 65535], got {port}")
        snapshot_port = snapshot_port or port + 1
        if not 0 < snapshot_port < 65536 or snapshot_port == port:
            raise ValueError(f"--kv-events-snapshot-port must be in [1, 65535] and not --kv-events-port, got "
                             f"{snapshot_port}")  # fmt: skip
        self.sink = sink
        self.block_size = block_size
        self.epoch = os.urandom(8)  # this process's: a restarted replica starts a new epoch
        self.seq = 0
        self._last = time.monotonic()
        self.drops = DropLog("kv_snapshots", logger)  # requests that are not `snapshot`: counted, logged rarely
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SNDHWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._actx = zmq.asyncio.Context()
        self._snapshots = self._actx.socket(zmq.ROUTER)
        self._snapshots.setsockopt(zmq.MAXMSGSIZE, 1024)  # requests are one word
        self._snapshots.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(f"tcp://{host}:{port}")
            self._snapshots.bind(f"tcp://{host}:{snapshot_port}")
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"KV events: cannot bind {host}:{port} / {snapshot_port}: {exc}") from None
        self.address = f"{host}:{port}"
        self.snapshot_address = f"{host}:{snapshot_port}"

    def publish(self, heartbeat: bool = False) -> None:
        """Send the events pending since the last call (an empty batch too when `heartbeat`)."""
        events = self.sink.take()
        if not events and not heartbeat:
            return
        for start in range(0, max(1, len(events)), MAX_EVENTS_PER_BATCH):
            self.seq += 1
            chunk = events[start : start + MAX_EVENTS_PER_BATCH]
            try:
                self._pub.send(encode_batch(self.epoch, self.seq, self.block_size, chunk), zmq.NOBLOCK)
            except zmq.Again:  # PUB drops at its high-water mark; subscribers see the hole and resynchronize
                pass
        self._last = time.monotonic()

    async def run(self) -> None:
        """Answer snapshot requests; send a heartbeat batch whenever HEARTBEAT_S passed without one."""
        try:
            while True:
                wait_ms = max(0.0, HEARTBEAT_S - (time.monotonic() - self._last)) * 1000
                if await self._snapshots.poll(wait_ms):
                    await self._answer(await self._snapshots.recv_multipart())
                if time.monotonic() - self._last >= HEARTBEAT_S:
                    self.publish(heartbeat=True)
        finally:
            self.close()

    async def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or frames[1] != SNAPSHOT_REQUEST:
            self.drops.drop("KV events: a request that is not %r", SNAPSHOT_REQUEST)
            return
        self.publish()  # what is pending goes out first, so the snapshot is exactly the state after self.seq
        reply = encode_snapshot(self.epoch, self.seq, self.block_size, self.sink.snapshot())
        await self._snapshots.send_multipart([frames[0], reply])

    def close(self) -> None:
        self.drops.flush()
        self._pub.close(0)
        self._snapshots.close(0)
        self._ctx.term()
        self._actx.term()
