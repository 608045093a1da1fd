"""What the doors ask of the engine: submitting a request (its sequences, to the scheduler and the output side),
aborting one, resizing the cache, draining, and whether a request can be admitted now. The engine core
(engine/core.py) owns it and answers the doors through it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from proto.transport import WorkerTransport
from proto.wire import SamplingOptions
from scheduler_node.core.kv.leases import new_lease
from scheduler_node.core.migration import SequenceResume
from scheduler_node.core.request import FinishReason, Request, RequestSpec, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.core.speculative import SpecState
from scheduler_node.engine.failures import Failures
from scheduler_node.engine.handoffs import Handoffs
from scheduler_node.engine.options import EngineOptions
from scheduler_node.engine.output_side import OutputSide
from scheduler_node.engine.outputs import Delta, DeltaSink, EngineError, ErrorStatus, RequestStream
from scheduler_node.engine.serving_state import ServingState
from scheduler_node.text.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)


class Intake:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: ModelTokenizer,
        workers: WorkerTransport,
        options: EngineOptions,
        outputs: OutputSide,
        state: ServingState,  # draining is this object's to set
        handoffs: Handoffs,  # an aborted request's leased or migrating KV
        failures: Failures,  # deadlines
        interrupt: Callable[[Request], bool],  # the plans in flight's: a new request may outrank them
        wake: asyncio.Event,  # the engine core's: there is work, or the workers must forget something
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.workers = workers
        self.options = options
        self.outputs = outputs
        self.state = state
        self.handoffs = handoffs
        self.failures = failures
        self.interrupt = interrupt
        self._wake = wake
        self._ids = itertools.count()  # the sequences' ids

    def queue_full(self, n: int) -> bool:
        """Would `n` more sequences overflow the waiting queue's bound?"""
        limit = self.options.max_waiting_requests
        return bool(limit) and len(self.scheduler.waiting) + n > limit

    @property
    def max_kv_blocks(self) -> int:
        """The most usable blocks a ResizeCache may set: what every rank of the world holds now."""
        return min(self.scheduler.blocks.num_blocks, self.workers.capacity.num_kv_blocks)

    @property
    def compact_tokens(self) -> int:
        """Tokens the workers' compact KV pool holds (0: none), the longest a `kv_precision="compact"` request
        may grow."""
        blocks = self.scheduler.blocks
        return blocks.num_compact_blocks * blocks.block_size

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + max_tokens) the world holds now: it follows a ResizeCache and a smaller
        replacement worker, so a request validated against it always fits."""
        return self.scheduler.max_model_len

    def is_live(self, request_id: str) -> bool:
        return request_id in self.outputs.requests

    def submit(self, spec: RequestSpec, deadline_s: float = 0.0) -> RequestStream:
        """Queue a request; with `deadline_s` > 0 it ends with DEADLINE_EXCEEDED that many seconds from now.
        Its deltas come in the stream returned, read on this loop."""
        stream = RequestStream(spec.request_id, len(spec.resume) or spec.n)
        self.submit_to(spec, stream, deadline_s)
        return stream

    def submit_to(self, spec: RequestSpec, stream: DeltaSink, deadline_s: float = 0.0) -> None:
        """`submit`, with the request's deltas put into `stream` (from the output thread if it is threadsafe)."""
        if spec.request_id in self.outputs.requests:
            raise KeyError(spec.request_id)
        if spec.kv_produce and spec.n != 1:
            raise ValueError(f"kv_produce: a prefill for another replica computes one sequence, not n = {spec.n}")
        if self.state.failed:
            raise RuntimeError(self.state.failed)
        refused = self._refusal(spec)
        if refused is not None:
            for index, _ in _sequences_of(spec):  # ends at once, engine untouched: no sequence would ever start
                stream.put(Delta(index, [], "", FinishReason.ERROR, error=refused))
            return
        eos = frozenset() if spec.ignore_eos else self.tokenizer.eos_token_ids
        stop = StopConditions(spec.max_tokens, eos, frozenset(spec.stop_token_ids), spec.sampling.min_tokens)
        # The worker bans the tokens that end the output until min_tokens, and lets a grammar end only with them.
        ending = msgspec.structs.replace(spec.sampling, stop_token_ids=sorted(eos | stop.stop_token_ids))
        sequences = [self._sequence(spec, ending, stop, index, resume) for index, resume in _sequences_of(spec)]
        self.outputs.add(spec, sequences, stream)
        if spec.resume:  # each continues from its own outputs; the prefix cache still shares the prompt's blocks
            for req in sequences:
                self.scheduler.add(req)
        else:
            self.scheduler.add(sequences[0], forks=sequences[1:])  # siblings share the prompt's blocks
        self.interrupt(sequences[0])
        if deadline_s > 0:
            self.failures.arm_deadline(spec.request_id, deadline_s)
        self._wake.set()

    def _refusal(self, spec: RequestSpec) -> EngineError | None:
        """Why a valid request ends at once, engine untouched (None: it is queued)."""
        if too_long := self._too_long(spec):
            return EngineError(ErrorStatus.UNAVAILABLE, too_long)
        if spec.lora is not None and (why := self.state.unusable_loras.get(spec.lora.id)):
            return EngineError(ErrorStatus.FAILED_PRECONDITION, why)
        return None

    def _sequence(
        self,
        spec: RequestSpec,
        sampling: SamplingOptions,
        stop: StopConditions,
        index: int,
        resume: SequenceResume | None,
    ) -> Request:
        """Sequence `index` of a request (seeded: seed + index), from where it stopped when it is resumed."""
        if spec.n > 1 and sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + index)
        return Request(
            f"{spec.request_id}#{next(self._ids)}",
            spec.prompt_token_ids,
            sampling,
            stop,
            spec.priority,
            output_token_ids=list(resume.output_token_ids) if resume else [],
            cache_salt=spec.cache_salt + (spec.lora.cache_salt if spec.lora else ""),
            kv_precision=spec.kv_precision,
            lora=spec.lora,
            spec=SpecState() if spec.speculate else None,  # the scheduler keeps it only if it speculates
            kv_lease=new_lease() if spec.kv_produce else b"",
            # Forks share the first's prompt blocks; a migrated sequence pulls its own KV.
            kv_source=resume.kv_source if resume else spec.kv_source if index == 0 else None,
            migrated_in=resume is not None,
            images=spec.images,
        )

    def _too_long(self, spec: RequestSpec) -> str:
        """Why a validated request can no longer fit ("" when it fits): the cache shrank (a ResizeCache, a smaller
        replacement worker) between its validation, off the event loop, and now."""
        compact = spec.kv_precision == "compact"
        limit = self.compact_tokens if compact else self.max_model_len
        prompt = len(spec.prompt_token_ids)
        if prompt + spec.max_tokens <= limit:
            return ""
        what = "the compact KV pool's size" if compact else "max_model_len"
        return (
            f"prompt ({prompt} tokens) + max_tokens ({spec.max_tokens}) exceeds {what} "
            f"({limit}): the KV cache shrank since the request was validated"
        )

    def abort(self, request_id: str) -> bool:
        ids = self.outputs.requests.get(request_id)
        if ids is None:
            return self.handoffs.release_kv(request_id)  # a finished prefill whose KV nobody will pull now
        for req_id in list(ids):
            req = self.scheduler.finish(req_id, Status.FINISHED_ABORTED)
            if req is not None:
                self.outputs.end(req)
        self.handoffs.migrate_without_kv(request_id)  # its client is gone: nobody will pull what it was migrating
        self._wake.set()  # tell the workers to forget them
        return True

    def resize_cache(self, num_blocks: int) -> int:
        """Change the usable KV blocks; the block moves run on the workers before the next step. ValueError
        outside [1, max_kv_blocks]; MemoryError when live requests would not fit (nothing changes then)."""
        if not 1 <= num_blocks <= self.max_kv_blocks:
            raise ValueError(f"num_blocks: must be in [1, {self.max_kv_blocks}], got {num_blocks}")
        moved = self.scheduler.resize(num_blocks)
        self._wake.set()
        return moved

    def stop_admitting(self) -> None:
        """From now on new requests are refused (UNAVAILABLE) and health says NOT_SERVING."""
        if not self.state.draining:
            self.state.draining = True
            logger.info("draining: %d live request(s)", self.outputs.num_live)
            self.workers.changed.set()  # health: NOT_SERVING

    async def drain(self, timeout: float | None, hurry: asyncio.Event | None = None) -> int:
        """Take no new requests; wait until every live one finished, `timeout` seconds passed, or `hurry` is
        set. Returns how many are still live."""
        self.stop_admitting()
        start = time.monotonic()
        waits = [self.outputs.idle.wait()] + ([hurry.wait()] if hurry is not None else [])
        await first_done(*waits, timeout=timeout)
        if not self.outputs.num_live and not (hurry and hurry.is_set()):  # migrated KV: served until pulled
            await self.handoffs.migrations_settled(None if timeout is None else timeout - (time.monotonic() - start))
        return self.outputs.num_live

    async def wait_idle(self) -> None:
        """Until no request is live."""
        await self.outputs.idle.wait()


def _sequences_of(spec: RequestSpec) -> list[tuple[int, SequenceResume | None]]:
    """The sequences a request runs: all n, or a migrated request's resumed ones."""
    if spec.resume:
        return [(resume.index, resume) for resume in spec.resume]
    return [(index, None) for index in range(spec.n)]


async def first_done(*waits: Coroutine[Any, Any, Any], timeout: float | None = None) -> bool:
    """Wait until the first of these finishes (True) or `timeout` seconds pass (False); cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return bool(done)
    finally:
        for task in tasks:
            task.cancel()
