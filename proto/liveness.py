"""The liveness pipe between a worker process and the local launcher that started it (vllm-serve, a TP/PP `LLM`).

The scheduler declares a silent worker lost, but cannot end a process that is alive and stuck (SIGSTOP, a hang
with the GIL held, a close that never returns): its launcher must, or no replacement ever starts. The launcher
hands each worker the write end of a pipe (`LIVENESS_FD_ENV`); a daemon thread of the worker writes BEAT every
BEAT_INTERVAL_S while the worker is alive and serving, and READY once it has joined the world. A worker whose
beats stop for longer than the scheduler's own bound — `--worker-join-timeout` while it joins, then
`--heartbeat-timeout` — is stalled: the launcher kills its process group and starts another, which rejoins.
The beats stop when the worker leaves its plan loop, so one that hangs on its way out is ended too.
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

LIVENESS_FD_ENV = "MINIVLLM_LIVENESS_FD"
BEAT, READY = b".", b"R"
BEAT_INTERVAL_S = 1.0


class Beats:
    """The worker's side: beats on the inherited pipe from a daemon thread (nothing without the variable)."""

    def __init__(self) -> None:
        fd = os.environ.get(LIVENESS_FD_ENV, "")
        self._fd = int(fd) if fd.isdigit() else -1
        self._stop = threading.Event()
        self._ready = False
        if self._fd >= 0:
            os.set_blocking(self._fd, False)  # a launcher that stopped reading must not stall this worker
            threading.Thread(target=self._run, name="liveness", daemon=True).start()

    def ready(self) -> None:
        """The worker joined the world: from now on the launcher applies the heartbeat timeout (said at once: the
        worker may stall before the next beat)."""
        self._ready = True
        self._write()

    def _write(self) -> bool:
        """One beat; False when the launcher is gone."""
        if self._fd < 0:
            return False
        try:
            os.write(self._fd, READY if self._ready else BEAT)
        except BlockingIOError:
            pass  # the pipe is full: the launcher has not read for a while, and knows this one is alive
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """The worker is leaving: no more beats (a worker that then hangs is ended by its launcher)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set() and self._write():
            self._stop.wait(BEAT_INTERVAL_S)


class Pulse:
    """The launcher's side, for one worker process: the read end of its pipe and when it last beat."""

    def __init__(self, join_timeout: float, heartbeat_timeout: float) -> None:
        self.join_timeout = join_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.ready = False
        self.last_beat = time.monotonic()

    def env(self) -> dict[str, str]:
        return {LIVENESS_FD_ENV: str(self.write_fd)}

    def started(self) -> None:
        """The child holds its copy of the write end now; the launcher's would keep the pipe open forever."""
        os.close(self.write_fd)

    def stalled_for(self) -> float:
        """Seconds without a beat past the bound that applies now (0 while within it)."""
        now = time.monotonic()
        try:
            data = os.read(self.read_fd, 4096)
            while data:  # everything written since the last look
                self.ready = self.ready or READY in data
                self.last_beat = now
                data = os.read(self.read_fd, 4096)
        except BlockingIOError:
            pass  # nothing more to read
        silent = now - self.last_beat
        bound = self.heartbeat_timeout if self.ready else self.join_timeout
        return silent if silent > bound else 0.0

    def close(self) -> None:
        os.close(self.read_fd)
