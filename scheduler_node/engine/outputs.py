"""What the engine streams back to a door: per-sequence deltas of tokens and text, in order, per request."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from proto.wire import TokenLogprobs
from scheduler_node.text.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class Delta:
    index: int  # which of the request's n sequences
    token_ids: list[int]
    text: str
    finish_reason: str = ""  # "" while running; stop | length | abort | error
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with the first tokens, when asked
    error: str = ""  # set with finish_reason "error": why the request failed
    code: str = ""  # with finish_reason "error": the gRPC status name (UNAVAILABLE, DEADLINE_EXCEEDED, ...)


class RequestStream:
    """The deltas of one client request (all n sequences), in order; iteration ends when every sequence ended.

    A deque and one waiter rather than an asyncio.Queue: the engine puts a delta per sequence per step, and this is
    half the queue's cost."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.unfinished = n
        self._ready: collections.deque[Delta] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting for a delta

    def put(self, delta: Delta) -> None:
        """From the engine loop: the next delta; wakes the reader if it waits."""
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


@dataclass(slots=True)
class SequenceOutput:
    """The output side of one sequence: its stream, its text so far (stop strings cut it), its timing."""

    stream: RequestStream
    index: int
    detokenizer: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    scheduled: bool = False
    last_token_at: float = 0.0  # 0 until the first token
    prompt_logprobs_sent: bool = False
