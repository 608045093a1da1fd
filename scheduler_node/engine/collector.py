"""The garbage collector's pauses, kept out of the engine's steps.

A full collection walks every object the collector tracks, and the engine's long-lived ones are many: each running
request holds its token lists, block hashes, block table, detokenizer and stream. At 1,024 sequences a full
collection costs several steps' worth of time, and the collector runs one whenever enough objects survived,
in the middle of whatever step is running. So, as vLLM does after its start-up:

- the start-up heap (modules, the tokenizer, the configuration) is frozen: no collection walks it again;
- a step that admitted requests freezes what is alive after it (mostly those requests, which live as long as
  they run): young collections then walk only the step's temporaries, and full ones have little to walk;
- the young generation's threshold is raised, so young collections run every few steps instead of several
  times a step (the engine's temporaries die by reference count: a rarer collection finds no more of them alive);
- frozen objects are never collected, so a cycle of garbage among them would stay: everything is unfrozen and
  collected when the engine has been idle a while (the engine waits `EngineOptions.idle_collection_delay_s`
  first: a full collection takes tens of milliseconds, which a request arriving just then would wait), and at
  most every `full_interval_s` seconds under a load that never lets it idle (one pause in thousands of steps).

Off by default: it changes the process's collector, which a server owns and a library user's process does not.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000  # allocations of tracked objects (net of deallocations) between young collections


class CollectorSchedule:
    def __init__(self, full_interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not full_interval_s > 0:
            raise ValueError(f"full_interval_s must be > 0, got {full_interval_s}")
        self.full_interval_s = full_interval_s
        self.clock = clock
        self.full_collections = 0
        self.admitted_since_idle = False  # a step admitted requests since the last idle collection: one is due
        self._last_full = clock()

    def start(self) -> None:
        """After start-up: collect once, freeze what survived, and raise the young generation's threshold."""
        _, middle, old = gc.get_threshold()
        gc.set_threshold(max(YOUNG_THRESHOLD, gc.get_threshold()[0]), middle, old)
        self.collect_all()

    def admitted(self) -> None:
        """A step admitted requests: they and what they hold live long, out of the collector's walks; a full
        collection runs here if the last one is `full_interval_s` old."""
        self.admitted_since_idle = True
        if self.clock() - self._last_full >= self.full_interval_s:
            self.collect_all()
        else:
            gc.freeze()

    def idle(self) -> None:
        """No request is live: the time for a full collection, frozen objects included."""
        self.admitted_since_idle = False
        self.collect_all()

    def collect_all(self) -> None:
        start = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self.full_collections += 1
        self._last_full = self.clock()
        logger.debug("full collection: %d unreachable, %.1f ms", found, (time.perf_counter() - start) * 1e3)
