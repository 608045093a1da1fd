"""Worker processes on this host: started, kept alive (a lost rank rejoins), stopped.

Used by vllm-serve (scheduler and workers as children) and by the offline `LLM` for TP/PP worlds.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

logger = logging.getLogger(__name__)


def worker_command(scheduler_address: str, flags: list[str]) -> list[str]:
    """The command line of a vllm-worker joining `scheduler_address` with these worker flags."""
    return [sys.executable, "-m", "worker_node.worker", "--scheduler-address", scheduler_address, *flags]


class WorkerProcess:
    """A worker process that is started again when it exits (a lost worker rejoins its rank), with a growing
    pause when it keeps exiting right after its start."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.failures = 0
        self.restart_at = 0.0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        self.started = time.monotonic()
        return subprocess.Popen(self.argv, start_new_session=True)  # a terminal's Ctrl-C reaches only the parent

    def keep_alive(self) -> None:
        if self.proc.poll() is None:
            return
        now = time.monotonic()
        if not self.restart_at:
            self.failures = self.failures + 1 if now - self.started < 30 else 0
            self.restart_at = now + (min(30.0, 2.0 ** (self.failures - 1)) if self.failures > 1 else 0.0)
            logger.warning(
                "worker pid %d exited with %s; a replacement starts in %.0f s",
                self.proc.pid,
                self.proc.returncode,
                self.restart_at - now,
            )
        if now >= self.restart_at:
            self.restart_at = 0.0
            self.proc = self._start()


def stop_processes(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM each, wait up to `timeout` seconds in all, then kill what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop in time; killing it", p.pid)
            p.kill()
            p.wait()


def let_exit(procs: list[subprocess.Popen], timeout: float) -> None:
    """Give processes that were told to stop (Shutdown) up to `timeout` seconds to exit on their own."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return
