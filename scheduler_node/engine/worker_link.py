"""The ZeroMQ transport (proto/transport.py): worker handshake and rejoin, heartbeats, plans out, results back.

The socket is read and written from the event loop's thread without futures: a reader callback on its file
descriptor drains every waiting message, and sends are plain non-blocking calls (a few microseconds each, where
zmq.asyncio's future and the wake-up it schedules after every send cost tens: issue 24, a send per step). The
reader routes every message: Hello and Ready to the rank registry
(scheduler_node/engine/rank_registry.py: who holds which rank, in what state, and the world's capacity),
heartbeats to the liveness clock, results to the step waiting for them; anything malformed or unexpected is
dropped, counted and logged at a bounded rate (`drops`, proto/drop_log.py; the metric minivllm:dropped_messages).
A rank is lost when its connection drops (the socket monitor, confirmed by a probe), when it is silent for
`heartbeat_timeout` (a stalled process), or when the engine finds a step of it past its deadline (a hung step
thread whose socket thread still heartbeats); the steps in flight then fail with WorkerLost, and the rank is free
for a replacement worker to say Hello.

libzmq's own heartbeats (ZMTP PING/PONG) run on its I/O thread, so a worker's connection stays alive while this
process is busy; the application heartbeats below detect a stalled worker process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from proto.curve import configure_server
from proto.drop_log import DropLog
from proto.pending_steps import PendingSteps
from proto.transport import WorkerLost, WorldCapacity
from proto.wire import (
    HEARTBEAT_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    ZMQ_HEARTBEAT_IVL_MS,
    Assignment,
    Heartbeat,
    Interrupt,
    Message,
    Shutdown,
    StepError,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerReady,
    decode,
    encode,
)
from scheduler_node.engine.rank_registry import READY, Claim, RankRegistry, WorkerInfo

logger = logging.getLogger(__name__)


class WorkerLink:
    """The transport to worker processes over one ZMQ ROUTER socket."""

    def __init__(
        self, address: str, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S, curve_dir: str | None = None
    ) -> None:
        if heartbeat_timeout <= 0:
            raise ValueError(f"--heartbeat-timeout must be > 0, got {heartbeat_timeout}")
        self.address = address
        self.heartbeat_timeout = heartbeat_timeout
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises instead of dropping
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        self._auth: AsyncioAuthenticator | None = None
        if curve_dir:
            authorized = configure_server(self._sock, curve_dir)
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(authorized))  # only these worker keys get in
        self._sock.bind(f"tcp://{address}")
        # The same socket, plain (not owning it): what the reader callback and the sends use (`_drain`).
        self._raw: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        self._reading: asyncio.AbstractEventLoop | None = None  # the loop whose reader drains the socket
        self._closed = False  # the shadow must not touch the socket once its owner closed it
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.drops = DropLog("workers", logger)  # malformed or unexpected messages, and Hellos turned away
        self.registry = RankRegistry(self._send_message, heartbeat_timeout, self._fail_steps, drops=self.drops)
        self.registry.name = address
        self.output_rank = 0  # whose StepResult step() returns
        self._steps: PendingSteps[bytes] = PendingSteps()
        self.lost = self.registry.lost  # set while a rank is lost, until every rank is ready again
        self.changed = self.registry.changed  # set on every change of a rank's state; health reporting clears it
        self._tasks: list[asyncio.Task[None]] = []

    # ---- reading

    @property
    def claim(self) -> Claim:
        """Which free rank a joining worker gets (the default takes the lowest; a placement can match hosts)."""
        return self.registry.claim

    @claim.setter
    def claim(self, claim: Claim) -> None:
        self.registry.claim = claim

    @property
    def world_size(self) -> int:
        return self.registry.world_size

    @property
    def workers(self) -> list[WorkerInfo]:
        """The ready ranks, by rank."""
        return self.registry.workers

    @property
    def all_ready(self) -> bool:
        return self.registry.all_ready

    @property
    def num_ready(self) -> int:
        return len(self.workers)

    @property
    def lost_reason(self) -> str:
        return self.registry.lost_reason

    @property
    def capacity(self) -> WorldCapacity:
        return self.registry.capacity

    def status(self) -> list[WorkerInfo]:
        """Every rank's latest worker (ready or lost) and every worker still joining, by rank."""
        return self.registry.status()

    # ---- joining

    async def first_hello(self) -> WorkerHello:
        """The first worker's Hello, once one came (its answer waits for `start`): a scheduler without --model
        reads the world off it."""
        self._listen()
        await self.registry.hello_parked.wait()
        return self.registry.parked[0][1]

    async def start(self, assignment: Callable[[int], Assignment], timeout: float) -> WorldCapacity:
        """Wait until the world's workers said hello, got their rank and reported their KV capacity."""
        self.registry.assemble(assignment, timeout)
        self._listen()
        if not await self.wait_ready(timeout):
            raise TimeoutError(self.registry.not_ready(timeout))
        return self.capacity

    def _listen(self) -> None:
        """Read the socket from now on, and keep the liveness clock (once)."""
        if self._reading is not None:
            return
        loop = asyncio.get_running_loop()
        self._reading = loop
        loop.add_reader(self._raw.FD, self._drain)
        for job in (self._heartbeat_loop(), self._watch_disconnects()):
            self._tasks.append(loop.create_task(job))

    async def wait_ready(self, timeout: float | None) -> bool:
        """Wait until every rank is ready; False when `timeout` seconds passed first (None: no limit)."""
        try:
            await asyncio.wait_for(self.registry.all_ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # ---- steps

    def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        """Send the plan to every rank; the future completes with the output rank's result once every rank
        answered, or fails with WorkerLost (a rank was lost) or StepFailed (a rank could not run it)."""
        if not self.all_ready:
            raise WorkerLost(self.lost_reason or "not every rank is ready")
        workers = self.workers
        data = encode(plan)
        for w in workers:
            error = self._send_bytes(w.identity, data)
            if error:
                self.registry.lose(w, f"cannot send to it: {error}")
                raise WorkerLost(self.lost_reason)
        return self._steps.add(plan.step_id, {w.identity for w in workers}, workers[self.output_rank].identity)

    def interrupt(self, first_step_id: int, last_step_id: int) -> bool:
        """Ask a lone worker to skip the compute of steps first..last (sent, not answered). False when the
        world has several ranks: they could stop at different layers, and a half-run collective would hang."""
        if self.world_size != 1 or not self.all_ready:
            return False
        return not self._send_bytes(self.workers[0].identity, encode(Interrupt(first_step_id, last_step_id)))

    def declare_lost(self, reason: str) -> None:
        """Lose the ranks that owe an answer to the oldest step in flight (all ready ranks if none is in flight)."""
        owing = self._steps.oldest_owing()
        self.registry.lose_ready(owing if owing is not None else {w.identity for w in self.workers}, reason)

    def _fail_steps(self, reason: str) -> None:
        """A rank was lost: every step in flight fails with WorkerLost."""
        self._steps.fail_all(WorkerLost(reason))

    # ---- liveness

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_timeout / 4
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            late, last_tick = now - last_tick - interval, now
            if late > self.heartbeat_timeout / 2:  # our own loop stalled: heartbeats may wait unread
                logger.warning("the event loop was blocked for %.1f s; liveness check skipped", late)
                continue
            self.registry.tick(now)

    async def _watch_disconnects(self) -> None:
        """A dropped connection: find out whose by sending to each rank (a gone peer cannot be routed to)."""
        while True:
            try:
                await self._monitor.recv_multipart()
            except zmq.ZMQError:
                return
            for delay in (0.0, 0.05, 0.25, 1.0):  # the socket learns of the drop a moment after the monitor
                await asyncio.sleep(delay)
                if self.registry.probe():
                    break

    # ---- the socket

    def _drain(self) -> None:
        """Every message waiting. ZeroMQ's descriptor is edge-triggered, and any operation on the socket (a send
        too) may consume its edge: it is read until empty, and each send looks again (`_send_bytes`)."""
        raw = self._raw
        while not self._closed:
            try:
                if not self._readable():
                    return
                frames = raw.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # closed
            self._receive(frames)

    def _readable(self) -> bool:
        events = self._raw.getsockopt(zmq.EVENTS)
        return isinstance(events, int) and bool(events & zmq.POLLIN)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            self.drops.drop("a message of %d frames", len(frames))
            return
        identity, data = frames[0].bytes, frames[1].bytes
        try:
            msg = decode(data)
        except Exception as exc:  # WireError, or whatever a hostile payload provokes: never fatal
            self.drops.drop("a malformed message (%d bytes): %s", len(data), exc)
            return
        try:
            self._dispatch(identity, msg, _peer_address(frames[1]))
        except Exception:
            logger.exception("failed to handle a %s", type(msg).__name__)

    def _dispatch(self, identity: bytes, msg: Message, address: str) -> None:
        info = self.registry.seen(identity)
        if isinstance(msg, WorkerHello):
            self.registry.hello(identity, msg, address)
        elif isinstance(msg, WorkerReady):
            self.registry.ready(identity, msg)
        elif isinstance(msg, (StepResult, StepError)):
            if info is not None and info.state == READY:
                self._steps.answer(identity, msg)
        elif isinstance(msg, Heartbeat):
            if info is None:  # a worker this scheduler does not know (declared lost, or of a previous scheduler)
                self.registry.tell(identity, Shutdown("unknown to this scheduler; start again to join"))
        else:
            self.drops.drop("an unexpected %s", type(msg).__name__)

    def _send_message(self, identity: bytes, message: Message) -> str:
        return self._send_bytes(identity, encode(message))

    def _send_bytes(self, identity: bytes, data: bytes) -> str:
        """Send without waiting; return why it failed ("" when sent)."""
        if self._closed:
            return "the link is closed"
        try:
            self._raw.send_multipart([identity, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:
            return f"{type(error).__name__}: {error}"
        finally:
            if self._reading is not None and self._readable():
                self._reading.call_soon(self._drain)  # the send may have consumed the edge of a waiting message
        return ""

    async def close(self, reason: str) -> None:
        self.registry.shutdown_all(reason)
        if self._reading is not None:
            self._reading.remove_reader(self._raw.FD)
            self._reading = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._steps.cancel_all()
        if self._auth is not None:
            self._auth.stop()
        self._closed = True
        self.drops.flush()
        self._monitor.close(linger=0)
        self._sock.close(linger=1000)  # let the Shutdown messages leave
        self._ctx.term()


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return ""
