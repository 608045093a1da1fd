"""Free TCP ports for the processes a launch starts (schedulers, workers, torch.distributed, KV events)."""

from __future__ import annotations

import socket
import threading

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now that this process has not handed out before.

    The port is only probed, not held, so the kernel may offer it again once the probe closes: a caller that takes
    several ports before anything binds them (a scheduler's gRPC, OpenAI and KV-event ports) would then get one
    twice, and the second bind fails with "Address already in use"."""
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
