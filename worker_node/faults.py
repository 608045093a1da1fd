"""A step that fails for some of its requests' own reasons says whose: those requests fail alone.

A worker that cannot read a request's adapter, or whose inputs it cannot use, raises `RequestFault` naming the
requests (their handles); the step thread answers a StepError carrying them (proto/session_messages.py), and the
engine fails those requests and recomputes the rest (scheduler_node/engine/failures.py). Any other exception
blames nobody: the engine then retries the step's requests in halves until the one that fails runs alone.
"""

from __future__ import annotations

from collections.abc import Iterable


class RequestFault(Exception):
    """The plan cannot run because of these requests (handles); the reason is shown to their clients. `adapters`:
    the LoRA adapters (ids) that cannot be used, so that later requests naming them are refused at once instead of
    failing a step each."""

    def __init__(self, handles: Iterable[int], reason: str, adapters: Iterable[int] = ()) -> None:
        super().__init__(reason)
        self.handles = sorted(set(handles))
        self.reason = reason
        self.adapters = sorted(set(adapters))
