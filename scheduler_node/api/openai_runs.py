"""One HTTP request on the engine: its prompts submitted (n sequences each), their deltas merged in arrival order,
streamed as server-sent events or collected into one answer. Whatever way it ends — finished, failed, or the
client gone — every request it submitted is aborted unless finished, so its blocks return."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from scheduler_node.api.openai_encode import sse_event
from scheduler_node.api.openai_errors import OpenAIError, engine_error
from scheduler_node.api.openai_migration import migrated_event, migrated_params
from scheduler_node.api.openai_protocol import ResumeParams
from scheduler_node.api.openai_responses import Choice, Shape, Usage
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.outputs import Delta, RequestStream

DONE = "data: [DONE]\n\n"


@dataclass
class Run:
    engine: EngineCore
    specs: list[RequestSpec]
    shape: Shape
    streams: list[RequestStream] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    migrated: list[SequenceResume] = field(default_factory=list)  # its sequences' states, when a drain moved it
    taken_back: bool = False  # a request this draining replica migrated off, back: its KV lease is released here

    def __post_init__(self) -> None:
        self.n = self.specs[0].n
        self.choices = [Choice(i, self.specs[i // self.n].prompt_token_ids) for i in range(len(self.specs) * self.n)]
        self._counted: set[int] = set()  # prompts whose tokens are in usage

    def migrated_params(self) -> dict[str, Any]:
        """Where a run a drain moved stopped: what the router sends on as `resume`."""
        offsets = [choice.num_chars for choice in self.choices]
        request_id, created, tokens = self.specs[0].request_id, self.shape.created, self.usage.completion_tokens
        return migrated_params(request_id, created, self.migrated, tokens, offsets)

    def continue_from(self, params: ResumeParams) -> None:
        """A resumed run (live migration, api/openai_migration.py) goes on as the response its client has: its id
        and time, each choice's role sent and characters counted, the completion tokens of the sequences that
        ended before the move in its usage."""
        self.shape.response_id = params.request_id
        self.shape.created = params.created or self.shape.created
        for choice in self.choices:
            choice.started = True
        for choice, chars in zip(self.choices, params.text_offsets):
            choice.num_chars = chars
        self.usage.completion_tokens = params.completion_tokens

    def start(self) -> None:
        self.streams = [self.engine.submit(spec) for spec in self.specs]

    def abort(self, keep_leases: bool = False) -> None:
        """`keep_leases`: a finished prefill for another replica keeps its KV lease (an abort would release it)."""
        if self.migrated:  # its KV waits under a lease for the target: the router releases it (an Abort)
            return
        for spec in self.specs:
            if not (keep_leases and spec.kv_produce):
                self.engine.abort(spec.request_id)  # False, and nothing done, for a finished one

    async def deltas(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """Every sequence's deltas with the choice they belong to; raises OpenAIError when the engine failed one."""
        async for prompt, delta in _merged(self.streams):
            if self.taken_back:  # its first step imported the KV it left here: the lease has done its work
                self.engine.release_kv(self.specs[0].request_id)
                self.taken_back = False
            if delta.error is not None:
                raise engine_error(delta.error)
            if delta.migrated is not None:  # not the client's: the router continues it on another replica
                self.migrated.append(delta.migrated)
                continue
            if delta.finish_reason:
                self.usage.add(delta, prompt not in self._counted)
                self._counted.add(prompt)
            if delta.prompt_logprobs:  # the prompt's, once: every sequence of it shares them
                # Off the event loop: a long prompt's are tens of thousands of entries, each token's text decoded.
                ids = self.specs[prompt].prompt_token_ids
                shared = await asyncio.to_thread(self.shape.prompt_logprobs, ids, delta.prompt_logprobs)
                for j in range(self.n):
                    self.choices[prompt * self.n + j].prompt_logprobs = shared
            yield self.choices[prompt * self.n + delta.index], delta

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """The answer as server-sent events, ending with `data: [DONE]`; an engine failure mid-stream is an
        error event (the status line is long gone). A stream a drain moved ends with its `migrated` event."""
        try:
            async for choice, delta in self.deltas():
                chunk = self.shape.stream_choice(choice, delta)
                if chunk is not None and delta.prompt_logprobs:  # the one large chunk: encoded off the loop
                    yield await asyncio.to_thread(sse_event, self.shape.envelope(self.shape.chunk_name, [chunk], None))
                elif chunk is not None:
                    yield self.shape.sse(chunk)
            if self.migrated:
                yield migrated_event(self.migrated_params())
                return
            if include_usage:
                yield self.shape.sse(usage=self.usage)
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield DONE

    async def answer(self, receive: Receive) -> dict[str, Any]:
        """The whole answer; OpenAIError(499) when the client disconnects first."""
        finished = False
        try:
            finished = await until_done_or_gone(self._collect(), receive)
        finally:
            self.abort(keep_leases=finished)
        if not finished:
            raise OpenAIError(499, "the client closed the connection")  # nobody reads it
        return self.shape.answer(self.choices, self.usage)

    async def _collect(self) -> None:
        async for choice, delta in self.deltas():
            self.shape.add(choice, delta)


class RunResponse(StreamingResponse):
    """A streamed run that ends when the client disconnects (not at the next token it would have been sent),
    and aborts what is unfinished however it ends."""

    def __init__(self, run: Run, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_done_or_gone(self.stream_response(send), receive)
        except OSError:  # the client went away between two chunks
            pass
        finally:
            self.run.abort()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt index, delta) from every stream as they come."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for delta in stream:
            queue.put_nowait((i, delta))
        queue.put_nowait(None)

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()


async def until_done_or_gone(work: Awaitable[None], receive: Receive) -> bool:
    """Run `work` until it finishes (True) or the client disconnects (False: `work` is cancelled). The request's
    body was read before: the only message left to receive is the disconnect."""

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False
    task.result()  # raises what it raised
    return True
