"""The OpenAI-compatible HTTP door (`--openai-port`): FastAPI served by uvicorn on the scheduler's own event loop,
driving the same EngineCore as the gRPC door (no extra hop, no second engine).

POST /v1/chat/completions (tools: api/tools.py), /v1/responses (api/responses_request.py), /v1/embeddings
(api/embeddings.py), /v1/completions
(streamed as server-sent events with `stream: true`), GET /v1/models; vLLM's POST /tokenize and /detokenize;
GET /health (200 exactly while gRPC health is SERVING) and /metrics (the registry `--metrics-port` serves). With an
API key every path but /health and /metrics (probes, Prometheus) needs `Authorization: Bearer KEY`; with a control
token the control routes (loading and unloading LoRA adapters) need `Authorization: Bearer TOKEN` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proto.structured import after_reasoning
from scheduler_node.api.chat_output import ChatOutput
from scheduler_node.api.embeddings import (
    EmbeddingRequest,
    EngineFailed,
    answer,
    check_dimensions,
    pooled,
    request_specs,
)
from scheduler_node.api.kv_handoff_fields import http_kv_fields, source_params
from scheduler_node.api.openai_encode import json_response
from scheduler_node.api.openai_errors import OpenAIError, engine_error, install_handlers
from scheduler_node.api.openai_guards import BearerAuth, BodyLimit, control_routes
from scheduler_node.api.openai_inputs import chat_images, chat_specs, completion_specs, template_messages
from scheduler_node.api.openai_lora import adapter_cards, adapter_of, install_lora_routes
from scheduler_node.api.openai_migration import migrated_answer, with_migration
from scheduler_node.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from scheduler_node.api.openai_responses import ChatShape, CompletionShape, Shape
from scheduler_node.api.openai_runs import Run, RunResponse
from scheduler_node.api.reasoning_parsers import ReasoningParser, ReasoningStream, reasoning_parser_class
from scheduler_node.api.request_bounds import MAX_REQUEST_BYTES, check_prompt_logprobs
from scheduler_node.api.responses_request import ResponsesRequest, responses_error
from scheduler_node.api.responses_shape import ResponseBuilder, response_answer, response_events
from scheduler_node.api.resume import taken_back
from scheduler_node.api.tool_parsers import tool_parser_class
from scheduler_node.api.tools import ToolPlan
from scheduler_node.api.validation import (
    InvalidField,
    priority_from,
    prompt_from_ids,
    prompt_from_messages,
    prompt_from_text,
)
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.metrics import Metrics
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.server import OpenAIApi

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = MAX_REQUEST_BYTES  # as the gRPC door's messages

MakeSpecs = Callable[[Any, ModelTokenizer, int, str, int, int], list[RequestSpec]]
_API = OpenAIApi()  # the door's settings' defaults (settings/server.py)


@dataclass(frozen=True, slots=True)
class OpenAIConfig:
    """What the door is built with: where it listens and the name it answers to (resolved by the scheduler), its
    credentials, and its settings (settings/server.py OpenAIApi)."""

    host: str
    port: int
    model_name: str  # what /v1/models lists and `model` must name
    api_key: str = ""  # "": no authentication
    control_token: str = ""  # the control routes' credential ("": the API key's, like every route)
    tool_call_parser: str = _API.tool_call_parser
    reasoning_parser: str = _API.reasoning_parser
    embedding_pooling: str = _API.embedding_pooling


class OpenAIDoor:
    """The door's state; `engine` is set once the workers have joined (until then: 503)."""

    def __init__(self, config: OpenAIConfig, tokenizer: ModelTokenizer, metrics: Metrics) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.engine: EngineCore | None = None
        self.tool_parser = tool_parser_class(config.tool_call_parser)  # ValueError at start when it is wrong
        self.reasoning_parser = reasoning_parser_class(config.reasoning_parser)

    def chat_output(self, plan: ToolPlan) -> ChatOutput | None:
        """How one chat choice's output is read (None: it is all content)."""
        calls = plan.calls(self.tool_parser)
        reasoning = None if self.reasoning_parser is None else ReasoningStream(self.reasoning_parser())
        return None if calls is None and reasoning is None else ChatOutput(reasoning, calls)

    def ready_engine(self, resume_id: str = "") -> EngineCore:
        """The engine, or 503 naming why not. `resume_id`: a migrated request's, which a draining replica that
        moved it off takes back (vllm-router found no other replica for it)."""
        engine = self.engine
        if engine is None:
            raise OpenAIError(503, "the workers are joining; retry later")
        reason = engine.unavailable() or ("" if engine.workers.all_ready else "a worker is not ready")
        if reason and not taken_back(engine, resume_id, bool(resume_id)):
            raise OpenAIError(503, reason)
        return engine

    def check_model(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter `model` names (None: the base model); 404 when it names neither."""
        return adapter_of(self.engine, model, self.config.model_name)

    async def generate(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        request: Request,
        shape: Callable[..., Shape],
        prefix: str,
    ) -> Response:
        run = await self.start(body, request, shape, prefix)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return RunResponse(run, run.events(include_usage))
        large = run.shape.want_logprobs or run.shape.want_prompt_logprobs
        answer = await run.answer(request.receive)
        if run.migrated:  # a drain moved it: vllm-router continues it elsewhere
            return migrated_answer(run.migrated_params(), answer)
        spec = run.specs[0]
        if spec.kv_produce and (source := self.ready_engine().kv_source(spec.request_id)):
            answer["kv_transfer_params"] = source_params(source, spec.request_id)  # where a decode replica pulls
        return await json_response(answer, large=large)

    async def respond(self, body: ResponsesRequest, request: Request) -> Response:
        """POST /v1/responses: the chat request it means, in the Responses API's shapes."""
        try:
            chat = body.as_chat()
            run = await self.start(chat, request, ChatShape, "resp")
        except (InvalidField, OpenAIError) as exc:
            raise responses_error(exc) from None
        builder = ResponseBuilder(body, self.config.model_name)
        if body.stream:
            return RunResponse(run, response_events(run, builder))
        chat_answer = await run.answer(request.receive)
        return await json_response(response_answer(run, builder, chat_answer), large=False)

    async def embed(self, body: EmbeddingRequest, request: Request) -> Response:
        """POST /v1/embeddings: each input's pooled final hidden states."""
        lora = self.check_model(body.model)
        engine = self.ready_engine()
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            priority = priority_from(body.priority, request.headers.get("x-priority"), engine.options.priorities)
            specs = await asyncio.to_thread(request_specs, body, self.tokenizer, engine.max_model_len, request_id,
                                            self.config.embedding_pooling, priority)  # fmt: skip
        except InvalidField as exc:
            raise OpenAIError(400, str(exc), exc.field) from None
        specs = [dataclasses.replace(spec, lora=lora) for spec in specs] if lora else specs
        engine = self.ready_engine()
        if engine.queue_full(len(specs)):
            limit = engine.options.max_waiting_requests
            raise OpenAIError(429, f"the waiting queue is full (--max-waiting-requests {limit}); retry later")
        try:
            vectors = await pooled(engine, specs)
            check_dimensions(body.dimensions, len(vectors[0]))
        except EngineFailed as exc:
            raise engine_error(exc.error) from None
        except InvalidField as exc:
            raise OpenAIError(400, str(exc), exc.field) from None
        prompt_tokens = sum(len(spec.prompt_token_ids) for spec in specs)
        body_out = await asyncio.to_thread(answer, vectors, body, self.config.model_name, prompt_tokens)
        return await json_response(body_out, large=True)

    async def start(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        request: Request,
        shape: Callable[..., Shape],
        prefix: str,
    ) -> Run:
        """The request checked, tokenized and submitted (OpenAIError when it cannot be)."""
        lora = self.check_model(body.model)
        resume_id = body.resume.request_id if body.resume is not None else ""
        engine = self.ready_engine(resume_id)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        plain = True  # its output is all content: a migrated stream continues it exactly
        make: MakeSpecs = chat_specs if isinstance(body, ChatCompletionRequest) else completion_specs
        try:
            if isinstance(body, ChatCompletionRequest):
                plan = body.tool_plan()
                shape = functools.partial(ChatShape, outputs=lambda: self.chat_output(plan))
                plain = self.chat_output(plan) is None
            priority = priority_from(body.priority, request.headers.get("x-priority"), engine.options.priorities)
            # Off the event loop: tokenizing a long prompt must not stall other requests' streams.
            specs = await asyncio.to_thread(
                make, body, self.tokenizer, engine.max_model_len, request_id, priority, engine.compact_tokens
            )
            if isinstance(body, ChatCompletionRequest):  # its image_url parts (reads and decodes: off the loop)
                specs = await asyncio.to_thread(chat_images, body, specs, engine.images, engine.max_model_len)
            check_prompt_logprobs(specs)
            if lora is not None:
                specs = [dataclasses.replace(spec, lora=lora) for spec in specs]
            specs = _with_kv_transfer(body, specs, bool(engine.workers.capacity.kv_addresses))
            if self.reasoning_parser is not None:  # a constraint applies to the answer after the reasoning
                specs = [_after_reasoning(spec, self.reasoning_parser) for spec in specs]
            specs = with_migration(body, specs, plain, self.tokenizer.vocab_size)
        except InvalidField as exc:
            raise OpenAIError(400, str(exc), exc.field) from None
        engine = self.ready_engine(resume_id)  # it may have started draining meanwhile
        if engine.queue_full(sum(spec.n for spec in specs)):
            limit = engine.options.max_waiting_requests
            raise OpenAIError(429, f"the waiting queue is full (--max-waiting-requests {limit}); retry later")
        sampling = specs[0].sampling
        want = sampling.logprobs is not None, sampling.prompt_logprobs is not None
        name = self.config.model_name if lora is None else lora.name  # the answer names what was asked
        run = Run(engine, specs, shape(request_id, name, self.tokenizer, *want), taken_back=engine.draining)
        if body.resume is not None:
            run.continue_from(body.resume)
        run.start()
        return run


def build_app(door: OpenAIDoor) -> FastAPI:
    app = FastAPI(title="minivllm", summary="OpenAI-compatible API")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    install_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await door.generate(body, request, ChatShape, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await door.generate(body, request, CompletionShape, "cmpl")

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await door.embed(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await door.respond(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = door.engine
        base = model_card(door.config.model_name, engine.max_model_len if engine else None)
        return model_list([base, *adapter_cards(engine, door.config.model_name)])

    install_lora_routes(app, lambda: door.engine, door.config.model_name)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        door.check_model(body.model)
        engine = door.ready_engine()
        try:
            ids = await asyncio.to_thread(_tokenize, body, door.tokenizer, engine.max_model_len)
        except InvalidField as exc:
            raise OpenAIError(400, str(exc), exc.field) from None
        strs = [door.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        door.check_model(body.model)
        engine = door.ready_engine()
        try:
            ids = prompt_from_ids(body.tokens, door.tokenizer, engine.max_model_len + 1, "tokens")
        except InvalidField as exc:
            raise OpenAIError(400, str(exc), exc.field) from None
        return {"prompt": door.tokenizer.decode(ids)}

    @app.get("/health")
    async def health() -> Response:
        door.ready_engine()  # 503 naming why not
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(door.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    config = door.config
    if config.api_key or config.control_token:  # added last: runs first; once the routes it tells apart are in
        app.add_middleware(BearerAuth, api_key=config.api_key, control_token=config.control_token,
                           control_routes=control_routes(app))  # fmt: skip
    return app


def _with_kv_transfer(
    body: ChatCompletionRequest | CompletionRequest, specs: list[RequestSpec], serves_kv: bool
) -> list[RequestSpec]:
    """The specs with what `kv_transfer_params` asks (a lease produced or pulled: one prompt only)."""
    fields = http_kv_fields(body.kv_transfer_params, specs[0].n, serves_kv, body.stream)
    if fields and len(specs) != 1:
        raise InvalidField("kv_transfer_params", f"a KV hand-off is for one prompt, got {len(specs)}")
    return [dataclasses.replace(spec, **fields) for spec in specs] if fields else specs


def _after_reasoning(spec: RequestSpec, parser: type[ReasoningParser]) -> RequestSpec:
    """The spec's constraint applied after the reasoning (which the grammar opens unless the template did)."""
    structured = spec.sampling.structured
    if structured is None:
        return spec
    start = "" if parser.opened_by_template else parser.start
    sampling = msgspec.structs.replace(spec.sampling, structured=after_reasoning(structured, parser.end, start))
    return dataclasses.replace(spec, sampling=sampling)


def model_card(name: str, max_model_len: int | None = None) -> dict[str, Any]:
    """One entry of GET /v1/models (vllm-router lists one per model it fronts)."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "minivllm"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}


def _tokenize(body: TokenizeRequest, tokenizer: ModelTokenizer, max_model_len: int) -> list[int]:
    if body.messages is not None and body.prompt is None:
        return prompt_from_messages(template_messages(body.messages), tokenizer, max_model_len)
    if body.messages is None and body.prompt is not None:
        return prompt_from_text(body.prompt, tokenizer, max_model_len, "prompt", body.add_special_tokens)
    raise InvalidField("prompt", "send exactly one of prompt or messages")


class _LoopServer(uvicorn.Server):
    """uvicorn without its own signal handlers: SIGTERM/SIGINT belong to the scheduler, which drains first."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


class OpenAIServer:
    """uvicorn serving an app (the door's, or vllm-router's) on the running event loop; the socket is bound here
    (OSError if taken), served from start()."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self._socket = socket.create_server((host, port), family=_family(host), backlog=2048)
        uv = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                            timeout_graceful_shutdown=2)  # fmt: skip
        self._server = _LoopServer(uv)
        self._task: asyncio.Task[None] | None = None
        self.address = f"{host}:{self._socket.getsockname()[1]}"

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        logger.info("OpenAI API on http://%s/v1", self.address)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
        self._socket.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
