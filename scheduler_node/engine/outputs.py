"""What the engine streams back to a door: per-sequence deltas of tokens and text, in order, per request."""

from __future__ import annotations

import asyncio
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
    """The deltas of one client request (all n sequences), in order; iteration ends when every sequence ended."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.unfinished = n

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while self.unfinished:
            delta = await self.queue.get()
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
