"""gRPC ingress: Generation.{Generate, Abort}, plus grpc.health.v1 and server reflection."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.wire import MAX_MESSAGE_BYTES
from scheduler_node.engine import Delta, Engine
from scheduler_node.tokenizer import ModelTokenizer
from scheduler_node.validation import InvalidField, validate

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["Generation"].full_name,
    pb.DESCRIPTOR.services_by_name["Control"].full_name,
    health.SERVICE_NAME,
    reflection.SERVICE_NAME,
)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self.engine: Engine | None = None  # set once the workers have joined

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        engine = self.engine
        if engine is None or engine.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, engine.failed if engine else "workers are joining")
            return
        try:
            spec = validate(request, self.tokenizer, engine.max_model_len)
        except InvalidField as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        if not spec.request_id:
            spec = dataclasses.replace(spec, request_id=uuid.uuid4().hex)
        if engine.is_live(spec.request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {spec.request_id!r} is already running")
            return
        stream = engine.submit(spec)
        done = False
        try:
            async for delta in stream:
                if delta.finish_reason == "error":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, delta.error)
                yield _response(spec.request_id, delta)
            done = True
        finally:
            if not done:  # the client went away, or the stream failed
                engine.abort(spec.request_id)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        found = self.engine is not None and self.engine.abort(request.request_id)
        return pb.AbortResponse(found=found)


class ControlService(pb_grpc.ControlServicer):
    def __init__(self, generation: GenerationService) -> None:
        self.generation = generation

    async def GetStats(  # noqa: N802
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.Stats:
        engine = self.generation.engine
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "workers are joining")
            raise AssertionError("abort raises")
        s = engine.scheduler
        return pb.Stats(
            total_blocks=s.blocks.num_blocks,
            used_blocks=s.blocks.num_used,
            free_blocks=s.blocks.num_free,
            kv_usage=s.blocks.usage,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions,
            block_size=s.config.block_size,
            max_model_len=s.config.max_model_len,
        )


def _response(request_id: str, d: Delta) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        request_id=request_id,
        index=d.index,
        token_ids=d.token_ids,
        text=d.text,
        finish_reason=d.finish_reason,
    )
    for lp in d.logprobs:
        resp.logprobs.add(logprob=lp.logprob, top=[pb.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])
    if d.finish_reason:
        resp.usage.prompt_tokens = d.prompt_tokens
        resp.usage.completion_tokens = d.completion_tokens
    return resp


def build_server(service: GenerationService, address: str) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_GenerationServicer_to_server(service, server)
    pb_grpc.add_ControlServicer_to_server(ControlService(service), server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    return server, health_service


async def set_serving(health_service: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAMES[0]):
        await health_service.set(name, status)
