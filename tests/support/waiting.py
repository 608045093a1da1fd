"""Waiting on a condition with a deadline, never for a fixed time: a test under load waits as long as it must and
fails naming what it waited for; an idle machine does not wait at all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> None:
    """Until `predicate()` is true; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true after {timeout} s: {what}")
        time.sleep(interval)


async def until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.001) -> None:
    """`wait_for` on an event loop: the loop runs (and may make the predicate true) while this waits."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true after {timeout} s: {what}")
        await asyncio.sleep(interval)
