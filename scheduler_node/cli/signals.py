"""The servers' signals: the first SIGINT/SIGTERM drains, a second ends the drain (vllm-scheduler, vllm-router)."""

from __future__ import annotations

import asyncio
import signal


def stop_signals() -> tuple[asyncio.Event, asyncio.Event]:
    """(stop, hurry) on the running loop: the first SIGINT/SIGTERM sets `stop` (drain), a second `hurry` (end it)."""
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return stop, hurry
