"""Giving the memory of a large refused request back to the operating system.

A refused request's objects die by reference count the moment the door lets go of them (the gRPC door refuses
without raising, so no traceback keeps its frame alive, see grpc_server.refuse), but glibc's allocator keeps the
freed pages of its arenas for the next allocation: a client sending nothing but large invalid requests (a 6 MiB
prompt of token ids, each refused) would leave the scheduler's resident size at its high-water mark, growing
with each arena its worker threads touched. `malloc_trim(0)` returns those pages; it walks every arena, so it
runs off the event loop, at most once per `min_interval_s`, and only after a request large enough to matter.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

TRIM_ABOVE_BYTES = 1024 * 1024  # a refused request at least this large is worth a trim


def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None


_TRIM = _libc_trim()


def malloc_trim() -> bool:
    """Return the allocator's free pages to the OS; False where the C library has no malloc_trim."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class HeapTrimmer:
    """`soon()` after a large request was let go: one trim runs in a thread, at most one per `min_interval_s`
    (a burst of refusals costs one trim after it, not one each)."""

    def __init__(self, min_interval_s: float = 0.5) -> None:
        self.min_interval_s = min_interval_s
        self.trims = 0
        self._pending = False
        self._last = -float("inf")

    def soon(self) -> None:
        if self._pending or _TRIM is None:
            return
        self._pending = True
        wait = max(0.0, self._last + self.min_interval_s - time.monotonic())
        asyncio.get_running_loop().call_later(wait, self._start)

    def _start(self) -> None:
        asyncio.ensure_future(self._trim())

    async def _trim(self) -> None:
        self._pending = False  # a request let go from now on needs a trim of its own
        self._last = time.monotonic()
        start = time.perf_counter()
        await asyncio.to_thread(malloc_trim)
        self.trims += 1
        logger.debug("malloc_trim after a large refused request: %.1f ms", (time.perf_counter() - start) * 1e3)
