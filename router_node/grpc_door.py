"""The router's gRPC door: the same minivllm.v1.Generation service as a scheduler's (Generate routed and streamed
through, Abort fanned out to every replica), with the request's `model` choosing the replicas. It also keeps the
router's open requests (of both doors) for a drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from router_node.disaggregate import Disaggregator
from router_node.replica import DOWN, ReplicaPool
from router_node.request import RouteRequest
from router_node.upstream import Forwarder, UpstreamError, forwarded_metadata
from scheduler_node.api.grpc_status import refuse
from scheduler_node.api.validation import MAX_ID_LENGTH

logger = logging.getLogger(__name__)


class RouterGeneration(pb_grpc.GenerationServicer):
    def __init__(self, forwarder: Forwarder, call_timeout: float) -> None:
        self.forwarder = forwarder
        self.pool: ReplicaPool = forwarder.router.pool
        self.call_timeout = call_timeout  # of the Abort and GetStats calls it fans out
        self.live: set[str] = set()  # request ids of the streams open through the router
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self.disaggregator: Disaggregator | None = None  # --disaggregate: prefill and decode on different replicas

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        refusal = self._refusal(request)
        if refusal is not None:  # refused without raising: see refuse()
            refuse(context, *refusal)
            return
        request.request_id = request.request_id or uuid.uuid4().hex  # one id across a retry, for Abort
        headers = [(k, v) for k, v in context.invocation_metadata() or () if isinstance(v, str)]
        route_request = from_grpc(request, dict(headers))
        with self.tracked(request.request_id):
            try:
                timeout = context.time_remaining()
                metadata = forwarded_metadata(headers)
                async for response in self._generate(request, route_request, timeout, metadata):
                    yield response
            except UpstreamError as exc:
                self.count_error(route_request.model, exc.code.name)
                refuse(context, exc.code, exc.details)

    def _generate(
        self,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's stream: with --disaggregate, a prompt worth moving is computed on a prefill replica first,
        a shorter one is computed and decoded on a decode replica (never a prefill-only one)."""
        disaggregator = self.disaggregator
        if disaggregator is None or request.HasField("kv_handoff"):
            return self.forwarder.generate(request, route_request, timeout, metadata)
        if disaggregator.worth_moving(route_request):
            return disaggregator.generate(request, route_request, timeout, metadata)
        return self.forwarder.generate(request, route_request, timeout, metadata, exclude=disaggregator.prefill_only())

    def _refusal(self, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str] | None:
        if self.draining:
            return grpc.StatusCode.UNAVAILABLE, "the router is draining; retry on another"
        if len(request.request_id) > MAX_ID_LENGTH:
            return grpc.StatusCode.INVALID_ARGUMENT, f"request_id: longer than {MAX_ID_LENGTH} characters"
        if request.request_id in self.live:
            return grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request.request_id!r} is already running"
        return None

    @contextlib.contextmanager
    def tracked(self, request_id: str) -> Iterator[None]:
        """A request open through the router (either door) while in this block: a drain waits for it."""
        self.live.add(request_id)
        self.idle.clear()
        try:
            yield
        finally:
            self.live.discard(request_id)
            if not self.live:
                self.idle.set()

    def count_error(self, model: str, code: str) -> None:
        model = model or self.forwarder.router.default_model
        model = model if model in self.pool.models else "(unknown)"  # labels only from the config
        self.forwarder.metrics.errors.labels(model, code).inc()

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        if not request.request_id:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
            return pb.AbortResponse()
        links = [self.forwarder.links[r.address] for r in self.pool.replicas if r.state != DOWN]
        answers = await asyncio.gather(
            *(link.generation.Abort(request, timeout=self.call_timeout) for link in links), return_exceptions=True
        )
        return pb.AbortResponse(found=any(isinstance(a, pb.AbortResponse) and a.found for a in answers))

    async def drain(self, timeout: float | None) -> int:
        """Stop admitting, then wait up to `timeout` s for the open streams; how many are still open."""
        self.draining = True
        self.pool.changed.set()  # health goes NOT_SERVING
        waiter = asyncio.ensure_future(self.idle.wait())
        await asyncio.wait({waiter}, timeout=timeout)
        waiter.cancel()
        return len(self.live)


def from_grpc(request: pb.GenerateRequest, headers: dict[str, str]) -> RouteRequest:
    which = request.WhichOneof("input")
    s = request.sampling
    return RouteRequest(
        model=request.model,
        request_id=request.request_id,
        prompt=request.prompt if which == "prompt" else "",
        prompt_token_ids=request.prompt_token_ids.ids if which == "prompt_token_ids" else (),
        messages=[(m.role, m.content) for m in request.messages.messages] if which == "messages" else (),
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        priority=request.priority if request.HasField("priority") else None,
        cache_salt=request.cache_salt,
        metadata=headers,
    )
