"""vllm-serve's supervision of what it started (scheduler_node/cli/serve.py): a scheduler that exits 0 (drained) is
started again with the same flags, dead or stalled workers are replaced by their launchers, SIGHUP starts a rolling
restart (scheduler_node/cli/rolling.py), and SIGINT/SIGTERM, a crash, the router's exit or a launcher that gives up
stop everything, the router first (it drains its streams), then the schedulers, then the workers."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time

from scheduler_node.cli.rolling import Deadlines, RollingRestart, ServeFleet
from scheduler_node.engine.data_parallel import ReplicaPlan
from scheduler_node.engine.launchers import Launcher
from scheduler_node.engine.processes import Restarts, terminate
from settings.worker import EXIT_BAD_FLAGS

logger = logging.getLogger("vllm-serve")

POLL_S = 0.2  # how often the loop looks at its children


def spawn(module: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A child in its own session, so a terminal's Ctrl-C reaches only vllm-serve, which drains in order."""
    return subprocess.Popen([sys.executable, "-m", module, *argv], env=env, start_new_session=True)


class Supervisor:
    """The loop over vllm-serve's children, until a signal or a failure; `schedulers` is the list a restarted
    scheduler replaces its predecessor in (a rolling restart reads it)."""

    def __init__(
        self,
        args: argparse.Namespace,
        plans: list[ReplicaPlan],
        launchers: list[Launcher],
        schedulers: list[subprocess.Popen],
        scheduler_flags: list[list[str]],
        routers: list[subprocess.Popen],
        env: dict[str, str],
    ) -> None:
        self.args, self.plans, self.launchers, self.env = args, plans, launchers, env
        self.schedulers, self.scheduler_flags, self.routers = schedulers, scheduler_flags, routers
        self.restarts = [Restarts() for _ in plans]
        self.signals = self.hangups = 0
        self.cancelled = threading.Event()
        self.rolling: threading.Thread | None = None

    def run(self) -> int:
        """Supervise until a signal (then 0) or a failure (its exit code); then stop everything."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hangup)
        code = 0
        while not self.signals and not code:
            if self.hangups:
                self.hangups = 0
                self.rolling = _roll(self.args, self.plans, self.schedulers, self.rolling, self.cancelled)
            self._restart_drained()
            code = self._failure()
            time.sleep(POLL_S)
        self._stop()
        return 0 if self.signals else code

    def _on_hangup(self, _signum: int, _frame: object) -> None:
        self.hangups += 1

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self.signals += 1
        if self.signals > 1:  # a second signal: the router and the schedulers end their drains at once
            for proc in [*self.routers, *self.schedulers]:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    def _restart_drained(self) -> None:
        """A scheduler that exited 0 drained (--exit-after-drain, a rolling restart): start it again; its workers
        rejoin it."""
        for i, proc in enumerate(self.schedulers):
            if proc.poll() == 0 and self.restarts[i].due(f"replica {i}: scheduler pid {proc.pid} exited with 0"):
                self.schedulers[i] = spawn("scheduler_node.cli.scheduler", self.scheduler_flags[i], self.env)
                logger.info("replica %d: scheduler started again as pid %d", i, self.schedulers[i].pid)

    def _failure(self) -> int:
        """The exit code that stops vllm-serve, 0 while none: a crash, the router's exit, a launcher giving up (the
        workers' flags are bad); each launcher restarts its dead workers first."""
        code = 0
        for proc in [*self.routers, *self.schedulers]:
            if proc.poll() is not None and (proc in self.routers or proc.returncode != 0):
                code = proc.returncode or 1
                logger.error("pid %d exited with %s; stopping the others", proc.pid, code)
        for launcher in self.launchers:
            launcher.keep_alive()
            if launcher.gave_up:
                logger.error("%s; stopping the others", launcher.gave_up)
                code = EXIT_BAD_FLAGS
        return code

    def _stop(self) -> None:
        self.cancelled.set()  # a rolling restart under way stops at its next step
        terminate(self.routers, self.args.shutdown_timeout + 15.0)  # the router drains its streams first
        terminate(self.schedulers, self.args.shutdown_timeout + 15.0)  # each drains, then stops its workers
        for launcher in self.launchers:
            launcher.stop(10.0)


def _roll(
    args: argparse.Namespace,
    plans: list[ReplicaPlan],
    schedulers: list[subprocess.Popen],
    running: threading.Thread | None,
    cancelled: threading.Event,
) -> threading.Thread | None:
    """SIGHUP: start a rolling restart of the replicas on a thread (not with one replica, nor twice at once)."""
    if len(plans) == 1:
        logger.warning("SIGHUP ignored: a rolling restart needs --data-parallel-size >= 2 (a single replica has no "
                       "other to move its streams to; restart vllm-serve, or SIGTERM its scheduler)")  # fmt: skip
        return running
    if running is not None and running.is_alive():
        logger.warning("SIGHUP ignored: a rolling restart is under way")
        return running
    fleet = ServeFleet([p.address for p in plans], schedulers, _router_address(args), args.control_token,
                       args.shutdown_timeout)  # fmt: skip
    stop_s = args.shutdown_timeout + 60 if args.shutdown_timeout else float("inf")
    deadlines = Deadlines(exit_s=60.0, stop_s=stop_s, back_s=args.worker_join_timeout + 60)
    rolling = RollingRestart(fleet, deadlines, cancelled)

    def run() -> None:
        try:
            rolling.run()
        finally:
            fleet.close()

    thread = threading.Thread(target=run, name="rolling-restart", daemon=True)
    thread.start()
    return thread


def _router_address(args: argparse.Namespace) -> str | None:
    """Where vllm-serve asks its router for its view of the replicas (None: it serves TLS)."""
    if args.tls_cert:
        return None
    host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else args.host
    return f"[{host}]:{args.port}" if ":" in host else f"{host}:{args.port}"
