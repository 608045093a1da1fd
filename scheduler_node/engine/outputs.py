"""What the engine streams back to a door: per-sequence deltas of tokens and text, in order, per request."""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from proto.wire import TokenLogprobs
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import FinishReason


class ErrorStatus(enum.Enum):
    """Why the engine failed a request, in no door's words. Each door maps it to its own protocol in one table:
    `GRPC_STATUS` (api/grpc_server.py), `HTTP_STATUS` (api/openai_errors.py); the offline LLM names it."""

    UNAVAILABLE = enum.auto()  # no world to run it: ranks lost past the rejoin timeout, draining, KV shrank below it
    DEADLINE_EXCEEDED = enum.auto()  # its deadline_s passed
    INTERNAL = enum.auto()  # a worker could not run its step, or the engine loop failed
    # The workers could not compute this request for a reason of its own (its adapter cannot be read, its logits
    # are not finite): it failed alone, every other request went on; the same request would fail again.
    FAILED_PRECONDITION = enum.auto()


@dataclass(frozen=True, slots=True)
class EngineError:
    """How the engine failed a request: the status a door maps, and the message it passes on."""

    status: ErrorStatus
    message: str


@dataclass(slots=True)
class Delta:
    index: int  # which of the request's n sequences
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None  # None while running
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache (device or offload tiers)
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with the first tokens, when asked
    error: EngineError | None = None  # set with finish_reason ERROR: why the request failed
    embedding: list[float] | None = None  # an embedding request's, with its finish
    migrated: SequenceResume | None = None  # with finish_reason MIGRATED: where the sequence stopped


class DeltaSink(Protocol):
    """Where one request's deltas go. The output thread calls `put` itself when `threadsafe`; otherwise the
    deltas of a step go to the engine's event loop in one call, and `put` runs there. A sink that is not
    `incremental` reads a sequence's output whole (the offline LLM's collectors): a sequence without stop strings
    or logprobs then gets its tokens and text in one delta when it ends, not one per step."""

    threadsafe: bool
    incremental: bool

    def put(self, delta: Delta) -> None: ...


class RequestStream:
    """The deltas of one client request (all n sequences), in order; iteration ends when every sequence ended.

    A deque and one waiter rather than an asyncio.Queue: the engine puts a delta per sequence per step, and this is
    half the queue's cost. Read on the engine's event loop, so put there too (not `threadsafe`)."""

    threadsafe = False
    incremental = True

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.unfinished = n
        self._ready: collections.deque[Delta] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting for a delta

    def put(self, delta: Delta) -> None:
        """On the event loop: the next delta; wakes the reader if it waits."""
        self._ready.append(delta)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take_ready(self) -> list[Delta]:
        """The deltas put and not read yet, without waiting (for a reader that is not iterating)."""
        ready = list(self._ready)
        self._ready.clear()
        return ready

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while self.unfinished:
            while not self._ready:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            delta = self._ready.popleft()
            if delta.finish_reason:
                self.unfinished -= 1
            yield delta
