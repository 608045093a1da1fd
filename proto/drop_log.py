"""What a socket drops, counted and logged at a bounded rate: malformed, oversized or unexpected messages.

Without CURVE anyone who reaches a port may send it anything, and one warning line per dropped message let a flood
of garbage grow the log by ~115 MiB in 10 s (issue 45). A `DropLog` counts every drop and writes at most one line
per `interval_s`, the first one at once: how many messages were dropped since the line before, the total, and the
last reason. The totals stay readable (`total`): the scheduler and the router export them as the Prometheus counter
`minivllm:dropped_messages` (by socket), and a worker's are read in-process.

A drop costs an increment, an assignment and a clock read; the reason is turned into text only for the line that
is written, so a flood costs less here than the decode that failed. One DropLog belongs to the thread that reads
its socket; another thread reading `total` sees it a drop late at worst.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

REPORT_INTERVAL_S = 10.0
MAX_REASON_CHARS = 300  # a reason may quote the message (a list of block ids): the line stays short


class DropLog:
    """Counts the messages one socket dropped and logs them, at most one line per `interval_s`."""

    def __init__(
        self,
        socket: str,
        log: logging.Logger,
        interval_s: float = REPORT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket = socket  # the name in the log line and the metric's label: "workers", "kv_transfer", ...
        self.total = 0
        self._log = log
        self._interval_s = interval_s
        self._clock = clock
        self._unreported = 0
        self._reason: object = ""
        self._args: tuple[object, ...] = ()
        self._next_report = float("-inf")  # the first drop is logged at once

    def drop(self, reason: object, *args: object) -> None:
        """Count one dropped message. `reason` says why: an exception, or a %-format with `args` (as logging's),
        formatted only if this drop's line is written."""
        self.total += 1
        self._unreported += 1
        self._reason, self._args = reason, args
        now = self._clock()
        if now >= self._next_report:
            self._report(now)

    def flush(self) -> None:
        """Log the drops not reported yet (at close: a flood that stopped between two lines is not left out)."""
        if self._unreported:
            self._report(self._clock())

    def _report(self, now: float) -> None:
        self._log.warning(
            "%s: dropped %d message(s) since the last report (%d in all; one line per %g s at most); the last: %s",
            self.socket, self._unreported, self.total, self._interval_s, self._last_reason(),
        )  # fmt: skip
        self._unreported = 0
        self._next_report = now + self._interval_s

    def _last_reason(self) -> str:
        try:
            text = str(self._reason) % self._args if self._args else str(self._reason)
        except (TypeError, ValueError):  # a format that does not fit its arguments: still say something
            text = f"{self._reason!s} {self._args!r}"
        return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."
