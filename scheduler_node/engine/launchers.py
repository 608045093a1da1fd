"""How vllm-serve starts its workers and keeps them alive: `local` child processes on this host (the default), or
`ray` actors in a placement group that follows the topology (scheduler_node/engine/ray_launcher.py, imported only
for `--launcher ray`). Either starts a dead worker again, so a lost rank is rejoined; the local launcher also
kills a stalled one (proto/liveness.py) and gives up on one that exits for bad flags."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Protocol

from proto.liveness import Pulse
from proto.parallel import ParallelLayout
from proto.wire import HEARTBEAT_TIMEOUT_S, WORKER_JOIN_TIMEOUT_S
from scheduler_node.engine.processes import Restarts, terminate
from settings.worker import EXIT_BAD_FLAGS

logger = logging.getLogger(__name__)


class Launcher(Protocol):
    gave_up: str  # why workers are no longer restarted ("" while they are): the server cannot serve

    def scheduler_flags(self) -> list[str]:
        """Flags the scheduler needs from this launcher (e.g. the topology it placed the ranks by)."""
        ...

    def start(self, scheduler_address: str, worker_flags: list[str]) -> None:
        """Start one vllm-worker per rank with these flags, connecting to the scheduler at HOST:PORT."""
        ...

    def keep_alive(self) -> None:
        """Start again the workers that died or stalled (called every fraction of a second)."""
        ...

    def stop(self, grace: float) -> None:
        """The scheduler told the workers to shut down: give them `grace` seconds, then end what is left."""
        ...


def make_launcher(args: argparse.Namespace, layout: ParallelLayout, env: dict[str, str] | None = None) -> Launcher:
    """`env`: added to the local workers' environment (a data-parallel replica's GPU slice)."""
    if args.launcher == "ray":
        from scheduler_node.engine.ray_launcher import RayLauncher  # ray only when asked for

        return RayLauncher(args, layout)
    return LocalLauncher(layout.world_size, env, args.worker_join_timeout, args.heartbeat_timeout)


class LocalLauncher:
    """Each rank a child process of vllm-serve, in its own session (a terminal's Ctrl-C reaches only vllm-serve).

    A worker is restarted when it exits, and killed (its process group) then restarted when it stalls: no beat on
    its liveness pipe for the scheduler's own bound (`join_timeout` while it joins, `heartbeat_timeout` once
    ready), so that the rank the scheduler declared lost gets a replacement. One that exits with EXIT_BAD_FLAGS
    is not restarted (it would fail the same way forever): `gave_up` says why."""

    def __init__(
        self,
        world_size: int,
        env: dict[str, str] | None = None,
        join_timeout: float = WORKER_JOIN_TIMEOUT_S,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.world_size = world_size
        self.env = {**os.environ, **(env or {})}
        self.join_timeout = join_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.argv: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.pulses: list[Pulse] = []
        self.restarts = [Restarts() for _ in range(world_size)]
        self.gave_up = ""

    def scheduler_flags(self) -> list[str]:
        return []

    def start(self, scheduler_address: str, worker_flags: list[str]) -> None:
        self.argv = [sys.executable, "-m", "worker_node.worker", "--scheduler-address", scheduler_address]
        self.argv += worker_flags
        for _ in range(self.world_size):
            proc, pulse = self._spawn()
            self.procs.append(proc)
            self.pulses.append(pulse)

    def _spawn(self) -> tuple[subprocess.Popen, Pulse]:
        pulse = Pulse(self.join_timeout, self.heartbeat_timeout)
        env = {**self.env, **pulse.env()}
        try:
            proc = subprocess.Popen(self.argv, start_new_session=True, env=env, pass_fds=(pulse.write_fd,))
        finally:
            pulse.started()
        return proc, pulse

    def keep_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                self._end_if_stalled(proc, self.pulses[i])
                continue
            if proc.returncode == EXIT_BAD_FLAGS:
                if not self.gave_up:
                    self.gave_up = f"worker pid {proc.pid} exited with {EXIT_BAD_FLAGS}: bad flags (its log says which)"
                    logger.error("%s; not restarting it", self.gave_up)
                continue
            if self.restarts[i].due(f"worker pid {proc.pid} exited with {proc.returncode}"):
                self.pulses[i].close()
                self.procs[i], self.pulses[i] = self._spawn()

    def _end_if_stalled(self, proc: subprocess.Popen, pulse: Pulse) -> None:
        silent = pulse.stalled_for()
        if not silent:
            return
        logger.error(
            "worker pid %d stalled: no liveness beat for %.1f s (stopped, or hung); killing its process group",
            proc.pid,
            silent,
        )
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the worker and its children
        except ProcessLookupError:
            pass
        try:
            proc.wait(5.0)  # the next look finds it exited and starts its replacement
        except subprocess.TimeoutExpired:
            logger.error("worker pid %d survived SIGKILL for 5 s", proc.pid)

    def stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self.procs:  # they got Shutdown: a SIGTERM during their exit only adds noise
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        terminate(self.procs)
        for pulse in self.pulses:
            pulse.close()
        self.pulses = []
