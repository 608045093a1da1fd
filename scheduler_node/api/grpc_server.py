"""gRPC ingress: Generation.{Generate, Abort}, plus grpc.health.v1 and server reflection."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.memory_stats import KvPool
from proto.wire import MAX_MESSAGE_BYTES
from scheduler_node.api.grpc_decode import DecodeGuard
from scheduler_node.api.grpc_lora import LoraControl
from scheduler_node.api.grpc_status import RETRY_AFTER, refuse
from scheduler_node.api.heap import TRIM_ABOVE_BYTES, HeapTrimmer
from scheduler_node.api.kv_handoff_fields import kv_fields, source_message
from scheduler_node.api.request_bounds import MAX_REQUEST_BYTES, check_prompt_logprobs
from scheduler_node.api.resume import state_message, taken_back, with_resume
from scheduler_node.api.security import ControlAuth
from scheduler_node.api.validation import InvalidField, validate
from scheduler_node.core.request import RequestSpec
from scheduler_node.core.stats import snapshot
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.outputs import Delta, ErrorStatus
from scheduler_node.engine.worker_link import WorkerLink
from scheduler_node.text.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)

MAX_MIGRATE_IDS = 4096  # Control.Migrate: request ids per call

# How the engine's failures reach a gRPC client: one status code each.
# UNAVAILABLE is for now, not for good: the trailer says when to try again (the HTTP doors' Retry-After).

GRPC_STATUS: dict[ErrorStatus, grpc.StatusCode] = {
    ErrorStatus.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorStatus.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorStatus.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorStatus.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["Generation"].full_name,
    pb.DESCRIPTOR.services_by_name["Control"].full_name,
    health.SERVICE_NAME,
    reflection.SERVICE_NAME,
)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, tokenizer: ModelTokenizer, served_model_name: str) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name  # a request naming another model is NOT_FOUND
        self.engine: EngineCore | None = None  # set once the workers have joined
        self.link: WorkerLink | None = None
        self.heap = HeapTrimmer()
        self.on_drained: Callable[[], None] | None = None  # --exit-after-drain: a drained Control.Drain stops us

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        spec = await self._admit(request, context)
        engine = self.engine
        if spec is None or engine is None:  # refused, the status set
            if request.ByteSize() >= TRIM_ABOVE_BYTES:  # its pages go back to the OS once gRPC lets go of it
                context.add_done_callback(lambda _: self.heap.soon())
            return
        stream = engine.submit(spec, request.deadline_s)
        done = False
        taken_back = engine.draining  # admitted while draining: a request this replica migrated, back (its KV here)
        try:
            async for delta in stream:
                if taken_back:  # its first step imported the KV it left here: the lease has done its work
                    engine.release_kv(spec.request_id)
                    taken_back = False
                if delta.error is not None:
                    code = GRPC_STATUS[delta.error.status]
                    if code == grpc.StatusCode.UNAVAILABLE:
                        context.set_trailing_metadata(RETRY_AFTER)
                    await context.abort(code, delta.error.message)
                # The delta with the prompt's logprobs is large (up to request_bounds' bound): built off the loop.
                resp = (
                    await asyncio.to_thread(_response, spec.request_id, delta)
                    if delta.prompt_logprobs
                    else _response(spec.request_id, delta)
                )
                if spec.kv_produce and delta.finish_reason and (source := engine.kv_source(spec.request_id)):
                    resp.kv_source.CopyFrom(source_message(source))  # where the decode replica pulls the prompt
                yield resp
            done = True
        finally:
            if not done:  # the client went away, or the stream failed
                engine.abort(spec.request_id)

    async def _admit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> RequestSpec | None:
        """The request to run, or None with the status of its refusal set on `context`."""
        engine = self.engine
        lora = None  # a LoRA adapter's name in `model` runs the request with it
        if request.model and request.model != self.served_model_name:
            lora = engine.loras.get(request.model) if engine is not None and engine.loras is not None else None
            if lora is None:
                detail = f"model: {request.model!r} is not served here (this server serves {self.served_model_name!r})"
                refuse(context, grpc.StatusCode.NOT_FOUND, detail)
                return None
        back = engine is not None and taken_back(engine, request.request_id, request.HasField("resume"))
        if engine is None or (engine.unavailable() and not back):
            refuse(context, grpc.StatusCode.UNAVAILABLE, engine.unavailable() if engine else "workers are joining")
            return None
        try:
            header = dict(context.invocation_metadata() or ()).get("x-priority")
            # Off the event loop: tokenizing a long prompt must not stall the streams of other requests.
            spec = await asyncio.to_thread(
                validate,
                request,
                self.tokenizer,
                engine.max_model_len,
                header,
                engine.compact_tokens,
                engine.options.priorities,
            )
            check_prompt_logprobs([spec], "sampling.prompt_logprobs")
            spec = with_resume(request, spec, self.tokenizer.vocab_size)
            spec = dataclasses.replace(spec, **kv_fields(request, spec.n, bool(engine.workers.capacity.kv_addresses)))
        except InvalidField as exc:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return None
        if not math.isfinite(request.deadline_s) or request.deadline_s < 0:
            detail = f"deadline_s: must be a finite number >= 0 (0: none), got {request.deadline_s}"
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, detail)
            return None
        if engine.queue_full(len(spec.resume) or spec.n):
            detail = (
                f"the waiting queue is full (--max-waiting-requests {engine.options.max_waiting_requests}); retry later"
            )
            refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, detail)
            return None
        if not spec.request_id:
            spec = dataclasses.replace(spec, request_id=uuid.uuid4().hex)
        if lora is not None:
            spec = dataclasses.replace(spec, lora=lora)
        if engine.is_live(spec.request_id):
            refuse(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {spec.request_id!r} is already running")
            return None
        return spec

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        found = self.engine is not None and self.engine.abort(request.request_id)
        return pb.AbortResponse(found=found)


class ControlService(LoraControl, pb_grpc.ControlServicer):
    def __init__(self, generation: GenerationService) -> None:
        self.generation = generation

    def engine_now(self) -> EngineCore | None:
        return self.generation.engine

    @property
    def parent(self) -> str:
        return self.generation.served_model_name

    async def _engine(self, context: grpc.aio.ServicerContext) -> EngineCore:
        engine = self.generation.engine
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "workers are joining")
            raise AssertionError("abort raises")
        return engine

    async def ListWorkers(  # noqa: N802
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        link, now = self.generation.link, time.monotonic()
        workers = link.status() if link is not None else []
        return pb.ListWorkersResponse(
            workers=[
                pb.WorkerStatus(
                    rank=w.rank,
                    host=w.host,
                    pid=w.pid,
                    device=w.device,
                    tp_rank=w.tp_rank,
                    pp_stage=w.pp_stage,
                    state=w.state,
                    heartbeat_age_s=now - w.last_seen,
                    num_kv_blocks=w.num_kv_blocks,
                )
                for w in workers
            ]
        )

    async def Drain(  # noqa: N802
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        engine = await self._engine(context)
        timeout = await drain_timeout(request, context)
        engine.stop_admitting()  # first: a migrated request sent back here at once is refused
        migrated = engine.migrate() if request.migrate else 0
        remaining = await engine.drain(timeout)
        if remaining == 0 and self.generation.on_drained is not None:
            self.generation.on_drained()  # the server stops with a grace: this answer still goes out
        return pb.DrainResponse(drained=remaining == 0, remaining=remaining, migrated=migrated)

    async def GetStats(  # noqa: N802
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.Stats:
        engine = await self._engine(context)
        stats = dataclasses.asdict(snapshot(engine.scheduler))
        stats["num_preemptions"] = stats["preemptions_recompute"] + stats["preemptions_swap"]
        loras = [pb.LoraPool(**dataclasses.asdict(m)) for m in engine.lora_memory()]
        return pb.Stats(**stats, memory=[_pool_message(p) for p in engine.kv_pools()], lora_memory=loras)

    async def Migrate(  # noqa: N802
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateResponse:
        engine = await self._engine(context)
        if not request.request_ids or len(request.request_ids) > MAX_MIGRATE_IDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_ids: 1 to {MAX_MIGRATE_IDS} ids")
        return pb.MigrateResponse(migrated=engine.migrate(set(request.request_ids)))

    async def ResizeCache(  # noqa: N802
        self, request: pb.ResizeCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResizeCacheResponse:
        engine = await self._engine(context)
        total = engine.max_kv_blocks  # what every rank holds now (a smaller replacement lowers it)
        if not 1 <= request.num_blocks <= total:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_blocks: must be in [1, {total}]")
        start = time.perf_counter()
        try:
            moved = engine.resize_cache(request.num_blocks)
        except MemoryError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"num_blocks: {exc}")
            raise
        return pb.ResizeCacheResponse(
            usable_blocks=engine.scheduler.blocks.usable_blocks,
            blocks_moved=moved,
            seconds=time.perf_counter() - start,
        )


async def drain_timeout(request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> float | None:
    """How long a Drain may wait: its timeout_s (0: no limit), cut to answer before the caller's own deadline."""
    if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be >= 0, got {request.timeout_s}")
    timeout: float | None = request.timeout_s or None
    left = context.time_remaining()
    if left is not None:
        timeout = min(timeout or left, max(0.0, left - 0.25))
    return timeout


def _response(request_id: str, d: Delta) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        request_id=request_id,
        index=d.index,
        token_ids=d.token_ids,
        text=d.text,
        finish_reason=d.finish_reason.value if d.finish_reason else "",
    )
    for lp in d.logprobs:
        resp.logprobs.add(logprob=lp.logprob, top=[pb.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])
    for lp in d.prompt_logprobs:
        resp.prompt_logprobs.add(logprob=lp.logprob, top=[pb.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])
    if d.migrated is not None:  # not an end: the client (vllm-router) resumes it elsewhere
        resp.migrated.CopyFrom(state_message(d.migrated))
    elif d.finish_reason:
        resp.usage.prompt_tokens = d.prompt_tokens
        resp.usage.completion_tokens = d.completion_tokens
        resp.usage.cached_tokens = d.cached_tokens
    return resp


def build_server(
    service: pb_grpc.GenerationServicer,
    address: str,
    credentials: grpc.ServerCredentials | None = None,
    control_token: str = "",
    control: pb_grpc.ControlServicer | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The gRPC server; TLS with `credentials`, and Control RPCs need the bearer `control_token` when set.
    `control` defaults to the scheduler's Control over `service` (vllm-router brings its own)."""
    if control is None:
        assert isinstance(service, GenerationService)
        control = ControlService(service)
    server = grpc.aio.server(
        interceptors=[DecodeGuard(), *([ControlAuth(control_token)] if control_token else [])],
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),  # larger: RESOURCE_EXHAUSTED, never read
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_GenerationServicer_to_server(service, server)
    pb_grpc.add_ControlServicer_to_server(control, server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    return server, health_service


def _pool_message(p: KvPool) -> pb.KvPool:
    return pb.KvPool(
        tier=p.tier,
        format=p.format,
        bytes_per_block=p.bytes_per_block,
        total_blocks=p.total_blocks,
        used_blocks=p.used_blocks,
        allocated_bytes=p.allocated_bytes,
        used_bytes=p.used_bytes,
        hits=p.hits,
    )
