"""How vllm-serve starts its workers and keeps them alive: `local` child processes on this host (the default), or
`ray` actors in a placement group that follows the topology (scheduler_node/engine/ray_launcher.py, imported only
for `--launcher ray`). Either starts a dead worker again, so a lost rank is rejoined."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from typing import Protocol

from proto.parallel import ParallelLayout
from scheduler_node.engine.processes import Restarts, terminate

logger = logging.getLogger(__name__)

LAUNCHERS = ("local", "ray")


class Launcher(Protocol):
    def scheduler_flags(self) -> list[str]:
        """Flags the scheduler needs from this launcher (e.g. the topology it placed the ranks by)."""
        ...

    def start(self, scheduler_address: str, worker_flags: list[str]) -> None:
        """Start one vllm-worker per rank with these flags, connecting to the scheduler at HOST:PORT."""
        ...

    def keep_alive(self) -> None:
        """Start again the workers that died (called every fraction of a second)."""
        ...

    def stop(self, grace: float) -> None:
        """The scheduler told the workers to shut down: give them `grace` seconds, then end what is left."""
        ...


def add_launcher_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="local: the workers are child processes of vllm-serve on this host; ray: Ray actors in a placement "
        "group of the Ray cluster at --ray-address, each TP group packed on one node",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="--launcher ray: the Ray cluster to join (HOST:PORT of its GCS, or 'auto'); default: $RAY_ADDRESS, "
        "else a new local Ray instance on this host",
    )


def make_launcher(args: argparse.Namespace, layout: ParallelLayout, env: dict[str, str] | None = None) -> Launcher:
    """`env`: added to the local workers' environment (a data-parallel replica's GPU slice)."""
    if args.launcher == "ray":
        from scheduler_node.engine.ray_launcher import RayLauncher  # ray only when asked for

        return RayLauncher(args, layout)
    return LocalLauncher(layout.world_size, env)


class LocalLauncher:
    """Each rank a child process of vllm-serve, in its own session (a terminal's Ctrl-C reaches only vllm-serve)."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.env = {**os.environ, **env} if env else None
        self.argv: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.restarts = [Restarts() for _ in range(world_size)]

    def scheduler_flags(self) -> list[str]:
        return []

    def start(self, scheduler_address: str, worker_flags: list[str]) -> None:
        self.argv = [sys.executable, "-m", "worker_node.worker", "--scheduler-address", scheduler_address]
        self.argv += worker_flags
        self.procs = [self._spawn() for _ in range(self.world_size)]

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.argv, start_new_session=True, env=self.env)

    def keep_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None and self.restarts[i].due(f"worker pid {proc.pid} exited with {proc.returncode}"):
                self.procs[i] = self._spawn()

    def stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self.procs:  # they got Shutdown: a SIGTERM during their exit only adds noise
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        terminate(self.procs)
