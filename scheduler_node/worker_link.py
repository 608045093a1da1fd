"""The scheduler's side of the ZMQ wire: worker handshake, plans out, results back."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import zmq
import zmq.asyncio

from proto.wire import (
    MAX_MESSAGE_BYTES,
    Assignment,
    Message,
    Shutdown,
    StepPlan,
    StepResult,
    WireError,
    WorkerHello,
    WorkerReady,
    decode,
    encode,
)

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A worker disconnected or stopped answering; the KV it held is gone."""


@dataclass(slots=True)
class WorkerInfo:
    rank: int
    identity: bytes
    host: str
    pid: int
    device: str
    num_kv_blocks: int = 0


class WorkerLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises instead of dropping
        self._sock.bind(f"tcp://{address}")
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.workers: list[WorkerInfo] = []
        self.lost = asyncio.Event()

    async def gather(
        self, world_size: int, assignment: Callable[[int], Assignment], timeout: float
    ) -> list[WorkerInfo]:
        """Wait until `world_size` workers said hello, got their rank and reported their KV capacity."""
        deadline = time.monotonic() + timeout
        pending: dict[bytes, WorkerInfo] = {}
        ready: dict[int, WorkerInfo] = {}
        while len(ready) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(ready))
                raise TimeoutError(f"workers for ranks {missing} did not join {self.address} within {timeout:.0f} s")
            try:
                identity, msg = await asyncio.wait_for(self._recv(), left)
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, WorkerHello) and identity not in pending and len(pending) < world_size:
                rank = len(pending)
                pending[identity] = WorkerInfo(rank, identity, msg.host, msg.pid, msg.device)
                logger.info("worker rank %d: pid %d on %s (%s)", rank, msg.pid, msg.host, msg.device)
                await self._send(identity, assignment(rank))
            elif isinstance(msg, WorkerReady) and identity in pending:
                info = pending[identity]
                info.num_kv_blocks = msg.num_kv_blocks
                ready[info.rank] = info
            else:
                logger.warning("ignoring %s from an unknown or extra worker", type(msg).__name__)
        self.workers = [ready[r] for r in range(world_size)]
        asyncio.get_running_loop().create_task(self._watch_disconnects())
        return self.workers

    async def step(self, plan: StepPlan) -> StepResult:
        """Send the plan to every rank and return the output rank's result."""
        if self.lost.is_set():
            raise WorkerLost("a worker was lost")
        for worker in self.workers:
            await self._send(worker.identity, plan)
        results: dict[bytes, StepResult] = {}
        while len(results) < len(self.workers):
            recv = asyncio.ensure_future(self._recv())
            lost = asyncio.ensure_future(self.lost.wait())
            done, _ = await asyncio.wait({recv, lost}, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                raise WorkerLost("a worker disconnected during a step")
            lost.cancel()
            identity, msg = recv.result()
            if isinstance(msg, StepResult) and msg.step_id == plan.step_id:
                results[identity] = msg
            else:
                logger.warning("ignoring unexpected %s during step %d", type(msg).__name__, plan.step_id)
        return results[self.workers[0].identity]

    async def close(self, reason: str) -> None:
        for worker in self.workers:
            try:
                await self._send(worker.identity, Shutdown(reason))
            except zmq.ZMQError:
                pass
        self._monitor.close(linger=0)
        self._sock.close(linger=1000)  # let the Shutdown messages leave
        self._ctx.term()

    async def _send(self, identity: bytes, message: Message) -> None:
        try:
            await self._sock.send_multipart([identity, encode(message)])
        except zmq.ZMQError as exc:
            raise WorkerLost(f"cannot reach worker: {exc}") from exc

    async def _recv(self) -> tuple[bytes, Message]:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames", len(frames))
                continue
            try:
                return frames[0], decode(frames[1])
            except WireError as exc:
                logger.warning("dropped a malformed message: %s", exc)

    async def _watch_disconnects(self) -> None:
        while True:
            try:
                await self._monitor.recv_multipart()
            except zmq.ZMQError:
                return
            logger.error("a worker disconnected")
            self.lost.set()
