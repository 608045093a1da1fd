"""The router's OpenAI HTTP door (`vllm-router --openai-port`): the API of a scheduler's door (api/openai_server.py)
in front of the replicas' own HTTP doors (their --openai-port, `http=HOST:PORT` in --replica).

A body is checked with the door's own request models (the same 400s in the same words), routed by its `model`
like a gRPC request (the same strategies, prefix keys and metrics), and sent on with `model` set to the chosen
replica's. The answer comes back as the replica sends it, chunk by chunk for a stream (no buffering). A request
that fails before any byte of its answer reached the client (the replica cannot be reached, answers 503, or drops
the connection first) goes once more to another replica of its model; a stream that breaks later ends with an
error event naming the replica, never a second copy of tokens the client already has. A LoRA adapter's request
that a replica answers 404 (unloaded there since the last probe) goes to another replica that lists it, or is 404.
With --disaggregate a completion or chat request is first sent, unstreamed with one output token and
`kv_transfer_params: {"produce": true}`, to a prefill replica, whose answer says where the prompt's KV waits; the
request then goes to a decode replica with those `kv_transfer_params` and streams from there, and the prefill's
lease is released (a gRPC Abort) once the decode replica's answer begins. A failed prefill only costs the decode
replica the prompt's compute. A completion or chat that a drain with migrate hands back goes on from another
replica, the client none the wiser (live migration: router/http_migration.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router_node.grpc_door import RouterGeneration
from router_node.http_migration import UPSTREAM_ERRORS, Attempt, MovedRequests, describe, error_message
from router_node.replica import Replica
from router_node.request import RouteRequest
from router_node.routing import Route, RouteError
from router_node.upstream import FORWARDED_HEADERS
from scheduler_node.api.embeddings import EmbeddingRequest
from scheduler_node.api.openai_errors import OpenAIError, install_handlers
from scheduler_node.api.openai_guards import BearerAuth, BodyLimit
from scheduler_node.api.openai_migration import MIGRATED_HEADER
from scheduler_node.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from scheduler_node.api.openai_server import MAX_BODY_BYTES, model_card, model_list
from scheduler_node.api.responses_request import ResponsesRequest

logger = logging.getLogger(__name__)

HANDOFF_PATHS = ("/v1/completions", "/v1/chat/completions")  # what --disaggregate splits into prefill and decode
PRIVATE_HEADERS = ("authorization",)  # never shown to a routing function


class RouterHttp:
    """Forwards OpenAI requests; `replica_api_key` is what the replicas' doors expect."""

    def __init__(self, generation: RouterGeneration, replica_api_key: str, connect_timeout: float) -> None:
        self.generation = generation
        self.forwarder = generation.forwarder
        self.router = generation.forwarder.router
        self.pool = generation.pool
        self.auth = {"Authorization": f"Bearer {replica_api_key}"} if replica_api_key else {}
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None  # made on the serving loop, at the first request
        self.moves = MovedRequests(self.forwarder, self.generation.count_error)  # live migration

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: Request, route_request: RouteRequest, stream: bool) -> Response:
        """Send the request's body to a replica of its model; its answer, streamed through when `stream`."""
        if self.generation.draining:
            raise OpenAIError(503, "the router is draining; retry on another")
        payload = json.loads(await request.body())
        if request.url.path in HANDOFF_PATHS:
            payload["migratable"] = True  # a draining replica hands it back (router/migration.py): it goes on here
        headers = {**self.auth, **{k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}}
        stack = contextlib.ExitStack()  # closed when the answer has been passed on (a stream: at its end)
        stack.enter_context(self.generation.tracked(f"http-{uuid.uuid4().hex}"))
        path, disaggregator = request.url.path, self.generation.disaggregator
        split = disaggregator is not None and path in HANDOFF_PATHS and "kv_transfer_params" not in payload
        moved = split and disaggregator is not None and disaggregator.worth_moving(route_request)
        prefill = await self._prefill(path, payload, headers, route_request) if moved else None
        exclude = disaggregator.prefill_only() if split and disaggregator else []
        try:
            replica, answer, data = await self._send(path, payload, headers, route_request, stream, stack, exclude)
        except BaseException:
            stack.close()
            raise
        finally:
            if prefill is not None and disaggregator is not None:  # the decode replica pulled (or never will)
                disaggregator.release(*prefill)

        async def resend(exclude: Sequence[Replica], route: Route | None) -> Attempt:  # to the next replica
            return await self._send(path, payload, headers, route_request, stream, stack, exclude, route)

        if not stream or answer.status != 200:
            try:
                if answer.status == 200 and answer.headers.get(MIGRATED_HEADER):
                    return await self.moves.collected(replica, answer, data, payload, resend)
                answer.release()
                return Response(data, answer.status, media_type=answer.content_type)
            finally:
                stack.close()
        events = self.moves.relay(replica, answer, data, stack, payload, resend)
        return StreamingResponse(events, media_type=answer.content_type)

    async def _send(
        self,
        path: str,
        payload: dict[str, Any],
        headers: Mapping[str, str],
        route_request: RouteRequest,
        stream: bool,
        stack: contextlib.ExitStack,
        exclude: Sequence[Replica] = (),
        route: Route | None = None,
    ) -> Attempt:
        """The replica that answered (`route`'s, when given), its response and the answer's first chunk (a stream)
        or whole body."""
        failed: list[Replica] = []
        while True:
            route = route or await self._route(route_request, [*failed, *exclude])
            replica, chosen, route = route.replica, route, None  # a retry is routed afresh
            payload["model"] = chosen.model  # the model's name, or the LoRA adapter's the request names
            self.forwarder.opened(replica)
            try:
                answer, data = await self._attempt(replica, path, payload, headers, whole=not stream)
            except UPSTREAM_ERRORS as exc:
                self.forwarder.closed(replica, chosen.ticket)
                details = describe(exc)
                if self.forwarder.unavailable(replica, details, False, failed):
                    logger.info("HTTP %s: retrying on another replica: %s", path, details)
                    continue
                self.generation.count_error(replica.model, "UNAVAILABLE")
                raise OpenAIError(503, f"replica {replica.spec.http} ({replica.model}): {details}") from None
            if answer.status == 503:
                answer.release()
                self.forwarder.closed(replica, chosen.ticket)
                if self.forwarder.unavailable(replica, error_message(data), False, failed):
                    logger.info("HTTP %s: retrying on another replica: %s", path, error_message(data))
                    continue
                return replica, answer, data
            if answer.status == 404 and chosen.adapter:
                # The adapter was unloaded there since the last probe: another replica may still serve it.
                answer.release()
                self.forwarder.closed(replica, chosen.ticket)
                replica.adapters -= {chosen.adapter}
                failed.append(replica)
                continue
            if chosen.ticket is not None:
                chosen.ticket.prefilled()  # the answer began (a stream's first chunk, or the whole body)
            stack.callback(self.forwarder.closed, replica, chosen.ticket)
            return replica, answer, data

    async def _prefill(
        self, path: str, payload: dict[str, Any], headers: Mapping[str, str], route_request: RouteRequest
    ) -> tuple[Replica, str] | None:
        """The prompt computed on a prefill replica (--disaggregate): its `kv_transfer_params` go into `payload`;
        that replica and the request id whose abort releases the lease. None when it failed or offered nothing."""
        disaggregator = self.generation.disaggregator
        assert disaggregator is not None
        body = {**payload, "stream": False, "n": 1, "max_tokens": 1, "kv_transfer_params": {"produce": True}}
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        for unused in ("stream_options", "logprobs", "top_logprobs", "prompt_logprobs", "min_tokens"):
            body.pop(unused, None)
        try:
            route = await self._route(route_request, disaggregator.decode_only())
            body["model"] = route.model
            self.forwarder.opened(route.replica)
            try:
                answer, data = await self._attempt(route.replica, path, body, headers, whole=True)
            finally:
                self.forwarder.closed(route.replica, route.ticket)
            answer.release()
            params = json.loads(data).get("kv_transfer_params") if answer.status == 200 else None
            if answer.status != 200:
                raise ValueError(f"HTTP {answer.status}: {error_message(data)}")
        except (*UPSTREAM_ERRORS, OpenAIError, ValueError) as exc:
            logger.info("HTTP %s: prefill failed, the decode replica computes the prompt: %s", path, exc)
            disaggregator.fallbacks += 1
            return None
        if not isinstance(params, dict) or not params.get("lease"):
            disaggregator.fallbacks += 1
            return None
        payload["kv_transfer_params"] = {k: params[k] for k in ("addresses", "lease", "blocks")}
        disaggregator.handoffs += 1
        return route.replica, str(params["request_id"])

    async def _attempt(
        self, replica: Replica, path: str, payload: dict[str, Any], headers: Mapping[str, str], whole: bool
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        sent = time.monotonic()
        answer = await self.session().post(f"http://{replica.spec.http}{path}", json=payload, headers=headers)
        streamed = answer.status == 200 and not whole  # an error's body is read whole, whatever was asked
        try:
            data = await (answer.content.readany() if streamed else answer.content.read())
        except BaseException:
            answer.close()
            raise
        if streamed:
            replica.observe_ttft(time.monotonic() - sent)  # a stream's first chunk: the role or the first token
        return answer, data

    async def _route(self, route_request: RouteRequest, failed: list[Replica]) -> Route:
        model = route_request.model or self.router.default_model
        if model in self.pool.models and not any(r.spec.http for r in self.pool.of_model(model)):
            raise OpenAIError(503, f"model {model!r}: no replica has an HTTP API (http=HOST:PORT in --replica)")
        without_http = [r for r in self.pool.replicas if not r.spec.http]
        try:
            return await self.forwarder.route(route_request, [*failed, *without_http])
        except RouteError as exc:
            if exc.code == "NOT_FOUND":
                raise OpenAIError(404, str(exc), "model", "model_not_found") from None
            self.generation.count_error(route_request.model, exc.code)
            raise OpenAIError(503, str(exc)) from None


def build_router_app(door: RouterHttp, api_key: str) -> FastAPI:
    app = FastAPI(title="minivllm router", summary="OpenAI-compatible API over several schedulers")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)  # added last: runs first
    install_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [(m.role, m.content) for m in body.messages]
        route = _route_request(request, body.model, body, messages=messages)
        return await door.forward(request, route, body.stream)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        first = body.prompt[0] if body.prompt else ""
        text, ids = (first, []) if isinstance(first, str) else ("", first)
        route = _route_request(request, body.model, body, prompt=text, prompt_token_ids=ids)
        return await door.forward(request, route, body.stream)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        items = [] if isinstance(body.input, str) else body.input
        messages = [(str(m.get("role", "")), m["content"]) for m in items if isinstance(m.get("content"), str)]
        text = body.input if isinstance(body.input, str) else ""
        route = _route_request(request, body.model, None, prompt=text, messages=messages)
        return await door.forward(request, route, body.stream)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        first = body.input[0] if body.input else ""
        text, ids = (first, []) if isinstance(first, str) else ("", first)
        route = _route_request(request, body.model, None, prompt=text, prompt_token_ids=ids)
        return await door.forward(request, route, False)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        messages = [(m.role, m.content) for m in body.messages or ()]
        route = _route_request(request, body.model, None, prompt=body.prompt or "", messages=messages)
        return await door.forward(request, route, False)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        return await door.forward(request, _route_request(request, body.model, None), False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        lengths = {m: max((r.load.max_model_len for r in door.pool.of_model(m)), default=0) for m in door.pool.models}
        cards = [model_card(m, lengths[m] or None) for m in door.pool.models]
        adapters = {(a, r.model) for r in door.pool.serving() for a in r.adapters if a not in door.pool.models}
        cards += [{**model_card(a, lengths[m] or None), "parent": m} for a, m in sorted(adapters)]
        return model_list(cards)

    @app.get("/health")
    async def health() -> Response:
        if door.generation.draining:
            raise OpenAIError(503, "the router is draining")
        missing = [m for m in door.pool.models if not door.pool.serving(m)]
        if missing:
            raise OpenAIError(503, f"no replica is serving {', '.join(missing)}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(door.forwarder.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _route_request(
    request: Request,
    model: str | None,
    body: ChatCompletionRequest | CompletionRequest | None,
    prompt: str = "",
    prompt_token_ids: list[int] | tuple[()] = (),
    messages: list[tuple[str, str]] | tuple[()] = (),
) -> RouteRequest:
    """What routing sees of an HTTP request: the same fields a gRPC request gives (so the prefix keys agree)."""
    headers = {k: v for k, v in request.headers.items() if k not in PRIVATE_HEADERS}
    max_tokens = body.max_tokens if body is not None else None
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens  # OpenAI's newer name wins, as at the door
    return RouteRequest(
        model=model or "",
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        max_tokens=max_tokens,
        priority=body.priority if body is not None else None,
        cache_salt=body.cache_salt if body is not None else "",
        metadata=headers,
    )
