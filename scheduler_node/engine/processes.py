"""Supervising worker processes: when to start a dead one again, and how to stop them."""

from __future__ import annotations

import logging
import subprocess
import time

logger = logging.getLogger(__name__)


class Restarts:
    """When to start a dead worker again: at once, then after a growing pause while it keeps exiting right after
    its start (up to 30 s)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.failures = 0
        self.restart_at = 0.0

    def due(self, what: str) -> bool:
        """`what` was found dead: is it time to start its replacement?"""
        now = time.monotonic()
        if not self.restart_at:
            self.failures = self.failures + 1 if now - self.started < 30 else 0
            self.restart_at = now + (min(30.0, 2.0 ** (self.failures - 1)) if self.failures > 1 else 0.0)
            logger.warning("%s; a replacement starts in %.0f s", what, self.restart_at - now)
        if now < self.restart_at:
            return False
        self.restart_at = 0.0
        self.started = now
        return True


def terminate(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM what still runs, SIGKILL what is still there after `timeout` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop in time; killing it", p.pid)
            p.kill()
            p.wait()
