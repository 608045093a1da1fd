"""AsyncLLMEngine: vLLM's asyncio API (`from_engine_args`, `async generate(prompt, sampling_params, request_id)`
yielding RequestOutputs, `abort`), a thin door over the engine core that `LLM` runs.

The engine core runs where `LLM` runs it: on its own event loop in a thread (a forward pass on the caller's loop
would stall every other coroutine of the caller for a step). A `generate` submits its request on that thread and
reads its deltas from a queue on the caller's loop, which the engine's output thread fills: requests from many
coroutines arrive in the one scheduler and batch together as the servers' do."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from types import EllipsisType
from typing import Any, TypeVar

from minivllm.engine_args import AsyncEngineArgs
from minivllm.llm import LLM
from minivllm.lm_cache import LMCache
from minivllm.lora_request import LoRARequest
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.prompts import Prompt
from minivllm.sampling_params import SamplingParams
from minivllm.scheduling import SchedulerArg
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.outputs import Delta

T = TypeVar("T")
SHUT_DOWN = "the engine was shut down"


class AsyncLLMEngine:
    """`AsyncLLMEngine(model, cache=LMCache(...), **settings)` or `AsyncLLMEngine.from_engine_args(args)`; takes
    what `LLM(...)` takes. `shutdown()` (or `with` / `async with`) stops it. The article's `AsyncLLMEngine(...,
    cache=cache)` runs as written: its `...` (Python's Ellipsis) stands for the arguments it leaves out, the
    defaults."""

    def __init__(
        self,
        model: str | AsyncEngineArgs | EllipsisType | None = None,
        *,
        cache: LMCache | None = None,
        scheduler: SchedulerArg | None = None,
        worker_backend: str = "auto",
        attention: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        if model is Ellipsis:
            model = None
        if isinstance(model, AsyncEngineArgs):  # also the article's `AsyncLLMEngine(args, cache=cache)`
            args = AsyncEngineArgs(model.model, **{**model.keywords(), **settings}) if settings else model
        else:
            args = AsyncEngineArgs(model, worker_backend=worker_backend, attention=attention, **settings)
        self.llm = LLM(args.model, cache=cache, scheduler=scheduler, **args.keywords())
        self._ids = itertools.count()
        self._streams: set[DeltaQueue] = set()

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, cache: LMCache | None = None) -> AsyncLLMEngine:
        return cls(engine_args, cache=cache)

    @property
    def engine(self) -> EngineCore:
        return self.llm.engine

    def on_engine(self, call: Callable[[EngineCore], T]) -> Future[T]:
        """Run `call(engine)` on the engine's thread (MemoryMonitor reads its stats so)."""
        return self.llm.on_engine(call)

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
        priority: int | str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's output so far after each step that added to it (cumulative, as vLLM's: the text and
        token ids from the start), the last with `finished=True`. Leaving the loop early aborts the request.
        `priority`: a number or a name of the engine's `priority_ranges` (None: its default).
        ValueError naming a bad field or a `request_id` already running; RuntimeError if the request fails."""
        request_id = f"async-{next(self._ids)}" if request_id is None else request_id
        spec, text = self.llm.request_spec(prompt, sampling_params or SamplingParams(), request_id, priority,
                                           lora_request)  # fmt: skip
        stream = DeltaQueue(asyncio.get_running_loop())
        self._streams.add(stream)
        output = Accumulated(spec, text)
        submitted = self.on_engine(lambda engine: engine.submit_to(spec, stream))
        try:
            try:
                await asyncio.wrap_future(submitted)
            except KeyError:
                raise ValueError(f"request_id: {request_id!r} is already running") from None
            while not output.finished:
                for delta in await stream.take():
                    output.add(delta)
                yield output.snapshot()
        finally:
            self._streams.discard(stream)
            if not output.finished:  # the caller left (break, cancel, error): the engine forgets the request
                submitted.add_done_callback(lambda done: self._abort_if_submitted(done, request_id))

    def _abort_if_submitted(self, submitted: Future[None], request_id: str) -> None:
        """Abort a request whose submission went in (not one refused as a duplicate: that id is another's)."""
        if not submitted.cancelled() and submitted.exception() is None:
            self._tell(lambda engine: engine.abort(request_id))

    async def abort(self, request_id: str) -> None:
        """End a running request: its `generate` yields a last output, finish_reason "abort". Unknown: nothing."""
        future = self._tell(lambda engine: engine.abort(request_id))
        if future is not None:
            await asyncio.wrap_future(future)

    def _tell(self, call: Callable[[EngineCore], T]) -> Future[T] | None:
        """`on_engine`, or None when the engine is shut down (nothing left to tell)."""
        try:
            return self.on_engine(call)
        except RuntimeError:  # its loop is closed
            return None

    def shutdown(self) -> None:
        """Stop the engine and its workers; a `generate` still running raises RuntimeError. Idempotent."""
        self.llm.close()
        for stream in list(self._streams):
            stream.close(SHUT_DOWN)

    def __enter__(self) -> AsyncLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)


class DeltaQueue:
    """One request's deltas, put by the engine's output thread (threadsafe), read on the caller's loop."""

    threadsafe = True
    incremental = True  # every step's tokens, as they come

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Delta | str] = asyncio.Queue()

    def put(self, delta: Delta | str) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:  # the caller's loop is closed: nobody reads this request any more
            pass

    def close(self, reason: str) -> None:
        self.put(reason)

    async def take(self) -> list[Delta]:
        """Every delta put so far, waiting for one; RuntimeError when the engine went away."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, str):
                raise RuntimeError(item)
        return items  # type: ignore[return-value]


class Accumulated:
    """A request's RequestOutput, grown by its deltas."""

    def __init__(self, spec: RequestSpec, text: str | None) -> None:
        self.spec, self.unfinished = spec, spec.n
        logprobs = spec.sampling.logprobs is not None
        completions = [CompletionOutput(i, "", [], "", [] if logprobs else None) for i in range(spec.n)]
        self.output = RequestOutput(spec.request_id, text, spec.prompt_token_ids, completions, finished=False)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def add(self, delta: Delta) -> None:
        if delta.error is not None:
            self.unfinished = 0
            failure = f"{delta.error.status.name}: {delta.error.message}"
            raise RuntimeError(f"request {self.spec.request_id} failed ({failure})")
        out, c = self.output, self.output.outputs[delta.index]
        if self.spec.sampling.prompt_logprobs is not None and out.prompt_logprobs is None and delta.prompt_logprobs:
            out.prompt_logprobs = [None, *delta.prompt_logprobs]  # they come with the first tokens
        c.token_ids.extend(delta.token_ids)
        c.text += delta.text
        if c.logprobs is not None:
            c.logprobs.extend(delta.logprobs)
        if delta.finish_reason:
            c.finish_reason = delta.finish_reason.value
            self.unfinished -= 1
            out.finished = not self.unfinished

    def snapshot(self) -> RequestOutput:
        """A copy the caller may keep: later steps do not change it."""
        out = self.output
        completions = [
            CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason,
                             None if c.logprobs is None else list(c.logprobs))
            for c in out.outputs
        ]  # fmt: skip
        prompt_logprobs = None if out.prompt_logprobs is None else list(out.prompt_logprobs)
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, completions, out.finished,
                             prompt_logprobs)  # fmt: skip
