"""vllm-serve's rolling restart (SIGHUP with --data-parallel-size >= 2): one replica at a time is drained with
migrate (its streams go on on the other replicas, through the router), exits 0 (--exit-after-drain), is started
again by vllm-serve with the same ports and flags (code upgraded on disk takes effect), and is back in the router's
routing before the next one goes. Never two replicas out at once: one that does not come back ends the round.

The steps are RollingRestart's; what they act on is a Fleet (ServeFleet: vllm-serve's schedulers and router)."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc

logger = logging.getLogger("vllm-serve")

# A restarted replica is found within a second (gRPC's default backoff grows to minutes while it loads).
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
ROUTER_PROBE_S = 2.0  # with TLS on the router: its probe (0.5 s apart, 1 s timeout) finds a replica back by then


class Fleet(Protocol):
    def size(self) -> int: ...

    def name(self, index: int) -> str:
        """How the log names the replica: its index and address."""
        ...

    def pid(self, index: int) -> int:
        """Its scheduler's pid now (vllm-serve starts a new one when it exits 0)."""
        ...

    def drain(self, index: int) -> pb.DrainResponse:
        """Control.Drain(migrate=true) of its scheduler (grpc.RpcError when it fails)."""
        ...

    def stop(self, index: int) -> None:
        """SIGTERM to its scheduler (it drains for at most --shutdown-timeout, then exits 0)."""
        ...

    def routed(self, index: int) -> bool:
        """It answers SERVING and the router routes to it."""
        ...


@dataclass(frozen=True, slots=True)
class Deadlines:
    exit_s: float  # from a drained Drain until its successor runs (the exit, plus a restart pause)
    stop_s: float  # from a SIGTERM (a Drain that failed or left requests running) until its successor runs
    back_s: float  # from the restart until the router routes to it (workers join, weights load)


class RollingRestart:
    """Restart every replica of `fleet`, one at a time (run() on a thread of its own); `cancelled` (vllm-serve is
    stopping) ends it between two polls."""

    def __init__(self, fleet: Fleet, deadlines: Deadlines, cancelled: threading.Event, poll_s: float = 0.1) -> None:
        self.fleet = fleet
        self.deadlines = deadlines
        self.cancelled = cancelled
        self.poll_s = poll_s

    def run(self) -> int:
        """How many replicas were restarted and are back (all of them, unless one failed or vllm-serve stops)."""
        count = self.fleet.size()
        logger.info("rolling restart of %d replicas, one at a time", count)
        for index in range(count):
            if not self.restart(index):
                if not self.cancelled.is_set():
                    logger.error("rolling restart stopped after %d of %d replicas", index, count)
                return index
        logger.info("rolling restart done: %d replicas restarted", count)
        return count

    def restart(self, index: int) -> bool:
        """Drain replica `index` with migrate, wait for its successor, then for the router to route to it."""
        fleet, name, old = self.fleet, self.fleet.name(index), self.fleet.pid(index)
        logger.info("rolling restart: %s (pid %d): draining with migrate", name, old)
        if self._drained(index, name):
            logger.info("rolling restart: %s: drained; waiting for it to exit", name)
            replaced = self._wait(lambda: fleet.pid(index) != old, self.deadlines.exit_s)
        else:
            replaced = False
        if not replaced and not self.cancelled.is_set():
            logger.warning("rolling restart: %s: still running; stopping it with SIGTERM", name)
            fleet.stop(index)
            replaced = self._wait(lambda: fleet.pid(index) != old, self.deadlines.stop_s)
        if not replaced:
            if not self.cancelled.is_set():
                logger.error("rolling restart: %s: pid %d did not give way to a new scheduler", name, old)
            return False
        logger.info("rolling restart: %s: restarted as pid %d; waiting until the router routes to it", name,
                    fleet.pid(index))  # fmt: skip
        if not self._wait(lambda: fleet.routed(index), self.deadlines.back_s):
            if not self.cancelled.is_set():
                logger.error("rolling restart: %s: not serving %.0f s after its restart", name, self.deadlines.back_s)
            return False
        logger.info("rolling restart: %s: serving again", name)
        return True

    def _drained(self, index: int, name: str) -> bool:
        """Whether its Drain left nothing running (then it exits by itself); False: SIGTERM ends it."""
        try:
            answer = self.fleet.drain(index)
        except grpc.RpcError as exc:
            logger.warning("rolling restart: %s: Control.Drain failed: %s: %s", name, exc.code().name, exc.details())
            return False
        logger.info("rolling restart: %s: %d request(s) migrated", name, answer.migrated)
        if not answer.drained:
            logger.warning("rolling restart: %s: %d request(s) still running after the drain", name, answer.remaining)
        return answer.drained

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.cancelled.is_set():
            if done():
                return True
            if time.monotonic() > deadline:
                return False
            self.cancelled.wait(self.poll_s)
        return False


class ServeFleet:
    """vllm-serve's replicas as a Fleet: their schedulers (the list vllm-serve replaces a restarted one in), reached
    on loopback; the router at `router` (None when it serves TLS: then a replica's own SERVING, plus the router's
    probe time, stands for the router's view)."""

    def __init__(
        self,
        addresses: Sequence[str],
        schedulers: Sequence[subprocess.Popen],
        router: str | None,
        control_token: str,
        drain_timeout_s: float,
    ) -> None:
        self.addresses = list(addresses)
        self.schedulers = schedulers
        self.metadata = [("authorization", f"Bearer {control_token}")] if control_token else None
        self.drain_timeout_s = drain_timeout_s
        self.channels = [grpc.insecure_channel(a, options=RECONNECT) for a in self.addresses]
        self.router = grpc.insecure_channel(router, options=RECONNECT) if router else None

    def size(self) -> int:
        return len(self.addresses)

    def name(self, index: int) -> str:
        return f"replica {index} ({self.addresses[index]})"

    def pid(self, index: int) -> int:
        return self.schedulers[index].pid

    def drain(self, index: int) -> pb.DrainResponse:
        request = pb.DrainRequest(timeout_s=self.drain_timeout_s, migrate=True)
        deadline = self.drain_timeout_s + 15 if self.drain_timeout_s else None
        stub = pb_grpc.ControlStub(self.channels[index])
        answer: pb.DrainResponse = stub.Drain(request, timeout=deadline, metadata=self.metadata)
        return answer

    def stop(self, index: int) -> None:
        proc = self.schedulers[index]
        if proc.poll() is None:
            proc.terminate()

    def routed(self, index: int) -> bool:
        if not _serving(self.channels[index]):
            return False
        if self.router is None:
            self._pause(ROUTER_PROBE_S)
            return True
        try:
            listed = pb_grpc.ControlStub(self.router).ListReplicas(
                pb.ListReplicasRequest(), timeout=5, metadata=self.metadata
            )
        except grpc.RpcError as exc:
            logger.warning("rolling restart: the router's ListReplicas failed: %s", exc.code().name)
            return False
        return any(r.address == self.addresses[index] and r.state == "serving" for r in listed.replicas)

    @staticmethod
    def _pause(seconds: float) -> None:
        threading.Event().wait(seconds)

    def close(self) -> None:
        for channel in [*self.channels, *([self.router] if self.router else [])]:
            channel.close()


def _serving(channel: grpc.Channel) -> bool:
    try:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
