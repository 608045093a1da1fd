"""The ZeroMQ transport (proto/transport.py): worker handshake and rejoin, heartbeats, plans out, results back.

One reader task owns the receive side and routes every message: Hello and Ready to the rank registry,
heartbeats to the liveness clock, results to the step waiting for them; anything malformed is dropped and
logged. A rank is lost when its connection drops (the socket monitor, confirmed by a probe), when it is silent
for `heartbeat_timeout` (a stalled process), or when the engine finds a step of it past its deadline (a hung step
thread whose socket thread still heartbeats); the steps in flight then fail with WorkerLost, and the rank is free
for a replacement worker to say Hello. With more than one rank, losing one restarts them all: a
torch.distributed world cannot take a new member.

The world's KV size is fixed once every rank of the first world is ready (the smallest rank's); a replacement is
told to allocate exactly that many blocks, so it fits the scheduler's table. One that truly cannot shrinks the
world's capacity instead of being turned away; the engine then shrinks the scheduler to it.

libzmq's own heartbeats (ZMTP PING/PONG) run on its I/O thread, so a worker's connection stays alive while this
process is busy; the application heartbeats below detect a stalled worker process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from proto.curve import configure_server
from proto.transport import StepFailed, WorkerLost, WorldCapacity
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

logger = logging.getLogger(__name__)

JOINING, READY, LOST = "joining", "ready", "lost"


@dataclass(slots=True)
class WorkerInfo:
    rank: int
    identity: bytes
    host: str
    pid: int
    device: str
    num_kv_blocks: int = 0
    num_host_blocks: int = 0
    swap_bytes_per_s: float = 0.0
    kv_cache_bytes: int = 0
    kv_format: str = ""
    tiers: WorkerReady | None = None  # its Ready: the world's capacity is computed from every rank's
    tp_rank: int = 0
    pp_stage: int = 0
    state: str = JOINING  # joining | ready | lost
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Step:
    waiting: set[bytes]  # ranks that have not answered yet
    output: bytes  # the rank whose result carries the sampled tokens
    future: asyncio.Future[StepResult]
    result: StepResult | None = None


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
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.world_size = 0
        self.output_rank = 0  # whose StepResult step() returns
        self.ranks: list[WorkerInfo | None] = []
        self._by_identity: dict[bytes, WorkerInfo] = {}  # joining and ready workers
        self._assignment: Callable[[int], Assignment] | None = None
        # Which free rank a joining worker gets: (hello, its address, the free ranks) -> one of them, or None to
        # turn it away. The default takes the lowest; a placement can match hosts and devices instead.
        self.claim: Callable[[WorkerHello, str, Sequence[int]], int | None] = lambda hello, address, free: free[0]
        self._capacity: WorldCapacity | None = None  # fixed once the first world is ready
        self._steps: dict[int, _Step] = {}
        self._all_ready = asyncio.Event()
        self.lost = asyncio.Event()  # set while a rank is lost, until every rank is ready again
        self.lost_reason = ""
        self.changed = asyncio.Event()  # set on every change of a rank's state; health reporting clears it
        self._tasks: list[asyncio.Task[None]] = []
        self._beats = 0
        self.join_timeout = 600.0  # a worker still loading after this long gives its rank back

    # ---- reading

    @property
    def workers(self) -> list[WorkerInfo]:
        """The ready ranks, by rank."""
        return [w for w in self.ranks if w is not None and w.state == READY]

    @property
    def all_ready(self) -> bool:
        return self._all_ready.is_set()

    @property
    def num_ready(self) -> int:
        return len(self.workers)

    @property
    def capacity(self) -> WorldCapacity:
        if self._capacity is None:
            raise RuntimeError("the world has not assembled yet")
        return self._capacity

    def status(self) -> list[WorkerInfo]:
        """Every rank's latest worker (ready or lost) and every worker still joining, by rank."""
        known = [w for w in self.ranks if w is not None]
        joining = [w for w in self._by_identity.values() if w.state == JOINING]
        return sorted(known + joining, key=lambda w: (w.rank, w.state != READY))

    # ---- joining

    async def start(self, assignment: Callable[[int], Assignment], timeout: float) -> WorldCapacity:
        """Wait until the world's workers said hello, got their rank and reported their KV capacity."""
        world_size = assignment(0).world_size
        self.world_size = world_size
        self.ranks = [None] * world_size
        self._assignment = assignment
        self.join_timeout = timeout
        loop = asyncio.get_running_loop()
        for job in (self._read_loop(), self._heartbeat_loop(), self._watch_disconnects()):
            self._tasks.append(loop.create_task(job))
        if not await self.wait_ready(timeout):
            joining = sorted(w.rank for w in self._by_identity.values() if w.state == JOINING)
            missing = [r for r, w in enumerate(self.ranks) if (w is None or w.state != READY) and r not in joining]
            text = f"workers for ranks {missing} did not join {self.address} within {timeout:.0f} s"
            if joining:  # they got their rank but never reported ready: loading, or at the rendezvous
                text += f"; ranks {joining} joined but were not ready (loading, or waiting for the others)"
            raise TimeoutError(text)
        return self.capacity

    async def wait_ready(self, timeout: float | None) -> bool:
        """Wait until every rank is ready; False when `timeout` seconds passed first (None: no limit)."""
        try:
            await asyncio.wait_for(self._all_ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _on_hello(self, identity: bytes, msg: WorkerHello, address: str) -> None:
        if identity in self._by_identity:
            logger.warning("ignoring a second Hello from pid %d", msg.pid)
            return
        free = self._free_ranks()
        rank = self.claim(msg, address, free) if free else None
        if rank is None or rank not in free or self._assignment is None:
            logger.warning("turning away pid %d on %s: every rank is taken", msg.pid, msg.host)
            self._send(identity, Shutdown(f"all {self.world_size} ranks of {self.address} are taken"))
            return
        a = self._assignment(rank)
        if self._capacity is not None:  # a replacement: it holds exactly what the world holds
            a = msgspec.structs.replace(
                a,
                num_kv_blocks=self._capacity.num_kv_blocks,
                num_swap_blocks=self._capacity.num_swap_blocks,
                num_compact_blocks=self._capacity.num_compact_blocks,
            )
        tp = max(1, a.tensor_parallel_size)
        info = WorkerInfo(rank, identity, msg.host, msg.pid, msg.device, tp_rank=rank % tp, pp_stage=rank // tp)
        self._by_identity[identity] = info
        logger.info("worker rank %d: pid %d on %s (%s)", rank, msg.pid, msg.host, msg.device)
        self._send(identity, a)
        self.changed.set()

    def _on_ready(self, identity: bytes, msg: WorkerReady) -> None:
        info = self._by_identity.get(identity)
        if info is None or info.state != JOINING or msg.rank != info.rank:
            logger.warning("ignoring Ready (rank %d) from a worker that was not assigned it", msg.rank)
            return
        info.num_kv_blocks = msg.num_kv_blocks
        info.num_host_blocks = msg.num_host_blocks
        info.swap_bytes_per_s = msg.swap_bytes_per_s
        info.kv_cache_bytes = msg.kv_cache_bytes
        info.kv_format = msg.kv_format
        info.tiers = msg
        info.state = READY
        info.last_seen = time.monotonic()
        self.ranks[info.rank] = info
        logger.info("rank %d ready: pid %d, %d KV blocks", info.rank, info.pid, info.num_kv_blocks)
        # At once, not at the next beat: until its first heartbeat a worker gives a silent scheduler its long
        # connect timeout, so a scheduler that died in between would leave it waiting minutes to exit.
        self._send(identity, Heartbeat(info.rank, self._beats, self.heartbeat_timeout))
        self._update_state()

    def _free_ranks(self) -> list[int]:
        taken = {w.rank for w in self._by_identity.values()}
        return [r for r, w in enumerate(self.ranks) if (w is None or w.state == LOST) and r not in taken]

    def _update_state(self) -> None:
        if self.world_size and len(self.workers) == self.world_size:
            self._settle_capacity()
            self._all_ready.set()
            self.lost.clear()
            self.lost_reason = ""
        else:
            self._all_ready.clear()
        self.changed.set()

    def _settle_capacity(self) -> None:
        """The world is complete: fix its capacity (first time), or shrink it to a replacement that holds less."""
        ready = self.workers
        new = WorldCapacity.of([w.tiers for w in ready if w.tiers is not None])
        old = self._capacity
        if old is not None and (new.num_kv_blocks, new.num_swap_blocks) != (old.num_kv_blocks, old.num_swap_blocks):
            logger.warning(
                "a replacement could not hold the world's KV size: %d KV blocks and %d swap blocks from now on "
                "(were %d and %d)",
                new.num_kv_blocks,
                new.num_swap_blocks,
                old.num_kv_blocks,
                old.num_swap_blocks,
            )
        if old is None or new != old:
            self._capacity = new

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
                self._lose(w, f"cannot send to it: {error}")
                raise WorkerLost(self.lost_reason)
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        output = workers[self.output_rank].identity
        self._steps[plan.step_id] = _Step({w.identity for w in workers}, output, future)
        return future

    def interrupt(self, first_step_id: int, last_step_id: int) -> bool:
        """Ask a lone worker to skip the compute of steps first..last (sent, not answered). False when the
        world has several ranks: they could stop at different layers, and a half-run collective would hang."""
        if self.world_size != 1 or not self.all_ready:
            return False
        return not self._send_bytes(self.workers[0].identity, encode(Interrupt(first_step_id, last_step_id)))

    def declare_lost(self, reason: str) -> None:
        """Lose the ranks that owe an answer to the oldest step in flight (all ready ranks if none is in flight)."""
        owing = next(iter(self._steps.values())).waiting if self._steps else {w.identity for w in self.workers}
        for identity in list(owing):
            info = self._by_identity.get(identity)
            if info is not None and info.state == READY:
                self._lose(info, reason)

    def _on_result(self, identity: bytes, msg: StepResult | StepError) -> None:
        step = self._steps.get(msg.step_id)
        if step is None or identity not in step.waiting:
            logger.debug("dropped a stale answer to step %d", msg.step_id)
            return
        if step.future.done():  # the engine dropped the plans in flight (a failed step, a recovery)
            del self._steps[msg.step_id]
            return
        if isinstance(msg, StepError):
            del self._steps[msg.step_id]
            step.future.set_exception(StepFailed(f"rank {msg.rank} could not run step {msg.step_id}: {msg.reason}"))
            return
        if identity == step.output:
            step.result = msg
        step.waiting.discard(identity)
        if not step.waiting:
            del self._steps[msg.step_id]
            assert step.result is not None
            step.future.set_result(step.result)

    # ---- liveness

    def _lose(self, info: WorkerInfo, reason: str) -> None:
        if info.state == LOST:
            return
        logger.error("rank %d (pid %d on %s) lost: %s", info.rank, info.pid, info.host, reason)
        self._dismiss(info, reason)
        self._disband(f"rank {info.rank} was lost")
        self.lost_reason = f"rank {info.rank} lost: {reason}"
        self.lost.set()
        error = WorkerLost(self.lost_reason)
        for step in self._steps.values():
            if not step.future.done():  # the engine may have cancelled it already (a failed step before)
                step.future.set_exception(error)
        self._steps.clear()
        self._update_state()

    def _dismiss(self, info: WorkerInfo, why: str) -> None:
        info.state = LOST
        self._by_identity.pop(info.identity, None)
        self._send(info.identity, Shutdown(f"declared lost: {why}"))  # reaches a stalled worker when it wakes

    def _disband(self, why: str) -> None:
        """A torch.distributed world cannot take a new member: when one rank of a world of several is gone, every
        other rank — ready, loading or at the rendezvous — leaves too, and the supervisor starts them all again
        (a replacement alone would wait at a rendezvous the others already passed)."""
        if self.world_size > 1:
            for w in list(self._by_identity.values()):
                self._dismiss(w, f"{why}; every rank restarts")

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
            self._beats += 1
            for w in self.workers:
                if now - w.last_seen > self.heartbeat_timeout:
                    self._lose(w, f"no heartbeat for {now - w.last_seen:.1f} s")
                else:
                    self._send(w.identity, Heartbeat(w.rank, self._beats, self.heartbeat_timeout))
            for w in list(self._by_identity.values()):
                if w.state == JOINING and now - w.last_seen > self.join_timeout:
                    logger.error(
                        "rank %d: pid %d did not get ready in %.0f s; freeing the rank",
                        w.rank,
                        w.pid,
                        now - w.last_seen,
                    )
                    del self._by_identity[w.identity]
                    self._send(w.identity, Shutdown(f"not ready within {self.join_timeout:g} s"))
                    self._disband(f"rank {w.rank} was not ready in time")
                    self.changed.set()

    async def _watch_disconnects(self) -> None:
        """A dropped connection: find out whose by sending to each rank (a gone peer cannot be routed to)."""
        while True:
            try:
                await self._monitor.recv_multipart()
            except zmq.ZMQError:
                return
            for delay in (0.0, 0.05, 0.25, 1.0):  # the socket learns of the drop a moment after the monitor
                await asyncio.sleep(delay)
                if self._probe():
                    break

    def _probe(self) -> bool:
        found = False
        for w in list(self._by_identity.values()):
            error = self._send_bytes(w.identity, encode(Heartbeat(w.rank, self._beats, self.heartbeat_timeout)))
            if not error:
                continue
            found = True
            if w.state == READY:
                self._lose(w, f"connection closed ({error})")
            else:  # it died while loading: its rank is free again
                logger.error("worker pid %d left while joining as rank %d", w.pid, w.rank)
                del self._by_identity[w.identity]
                self._disband(f"rank {w.rank} left while joining")
                self._update_state()
        return found

    # ---- the socket

    async def _read_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                return  # closed
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames", len(frames))
                continue
            identity, data = frames[0].bytes, frames[1].bytes
            try:
                msg = decode(data)
            except Exception as exc:  # WireError, or whatever a hostile payload provokes: never fatal
                logger.warning("dropped a malformed message (%d bytes): %s", len(data), exc)
                continue
            try:
                self._dispatch(identity, msg, _peer_address(frames[1]))
            except Exception:
                logger.exception("failed to handle a %s", type(msg).__name__)

    def _dispatch(self, identity: bytes, msg: Message, address: str) -> None:
        info = self._by_identity.get(identity)
        if info is not None:
            info.last_seen = time.monotonic()
        if isinstance(msg, WorkerHello):
            self._on_hello(identity, msg, address)
        elif isinstance(msg, WorkerReady):
            self._on_ready(identity, msg)
        elif isinstance(msg, (StepResult, StepError)):
            if info is not None and info.state == READY:
                self._on_result(identity, msg)
        elif isinstance(msg, Heartbeat):
            if info is None:  # a worker this scheduler does not know (declared lost, or of a previous scheduler)
                self._send(identity, Shutdown("unknown to this scheduler; start again to join"))
        else:
            logger.warning("ignoring an unexpected %s", type(msg).__name__)

    def _send(self, identity: bytes, message: Message) -> None:
        error = self._send_bytes(identity, encode(message))
        if error:
            logger.debug("could not send %s: %s", type(message).__name__, error)

    def _send_bytes(self, identity: bytes, data: bytes) -> str:
        """Send without waiting; return why it failed ("" when sent)."""
        sent = asyncio.ensure_future(self._sock.send_multipart([identity, data], flags=zmq.NOBLOCK))
        if not sent.done():  # queued behind another send: its failure, if any, goes to the log
            sent.add_done_callback(_log_send_failure)
            return ""
        error = sent.exception()
        return f"{type(error).__name__}: {error}" if error else ""

    async def close(self, reason: str) -> None:
        for w in list(self._by_identity.values()):
            self._send(w.identity, Shutdown(reason))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for step in self._steps.values():
            step.future.cancel()
        self._steps.clear()
        if self._auth is not None:
            self._auth.stop()
        self._monitor.close(linger=0)
        self._sock.close(linger=1000)  # let the Shutdown messages leave
        self._ctx.term()


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return ""


def _log_send_failure(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.debug("a queued send failed: %s", sent.exception())
