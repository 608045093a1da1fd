"""The OpenAI door's LoRA routes, as vLLM spells them: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
and the adapters' cards in `GET /v1/models` (each with its `parent`).

Loading reads server-side paths a client names, so the two are control routes (api/openai_guards.py): with
`--control-token` they need `Authorization: Bearer <control token>` (the API key does not open them), as their gRPC
twins in the Control service need it; without one, the API key like every route."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from proto.lora import AdapterError
from scheduler_node.api.openai_errors import OpenAIError
from scheduler_node.api.openai_guards import CONTROL_TAG
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.lora_registry import LoraRegistry, UnknownAdapter


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; the name decides


def adapter_of(engine: EngineCore | None, model: str | None, base_name: str) -> LoraRef | None:
    """The adapter a request's `model` names (None: the base model); 404 for a name that is neither."""
    if model is None or model == base_name:
        return None
    ref = engine.loras.get(model) if engine is not None and engine.loras is not None else None
    if ref is None:
        message = f"the model `{model}` does not exist; this server serves `{base_name}`"
        if engine is not None and engine.loras is not None:
            message += " and its LoRA adapters (GET /v1/models)"
        raise OpenAIError(404, message, "model", "model_not_found")
    return ref


def adapter_cards(engine: EngineCore | None, base_name: str) -> list[dict[str, Any]]:
    if engine is None or engine.loras is None:
        return []
    return [
        {"id": r.name, "object": "model", "created": 0, "owned_by": "minivllm", "root": r.path, "parent": base_name}
        for r in engine.loras.refs()
    ]


def install_lora_routes(app: FastAPI, engine_of: Any, base_name: str) -> None:
    """`engine_of()`: the door's engine, or None while the workers join."""

    def registry() -> LoraRegistry:
        engine: EngineCore | None = engine_of()
        if engine is None:
            raise OpenAIError(503, "the workers are joining; retry later")
        if engine.loras is None:
            raise OpenAIError(400, "LoRA is off: start the server with --enable-lora")
        return engine.loras

    @app.post("/v1/load_lora_adapter", tags=[CONTROL_TAG])
    async def load_lora_adapter(body: LoadLoraRequest) -> PlainTextResponse:
        """Register the adapter at `lora_path` under `lora_name`. A control route: with --control-token it needs
        `Authorization: Bearer <control token>`, else the API key when one is set."""
        loras = registry()
        if body.lora_name == base_name:
            raise OpenAIError(400, f"lora_name `{base_name}` is the base model's name", "lora_name")
        try:  # reads the whole adapter and checks every value: off the event loop
            await asyncio.to_thread(loras.add, body.lora_name, body.lora_path)
        except AdapterError as exc:
            raise OpenAIError(400, str(exc), "lora_path") from None
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", tags=[CONTROL_TAG])
    async def unload_lora_adapter(body: UnloadLoraRequest) -> PlainTextResponse:
        """Stop new requests from naming the adapter. A control route, guarded as load_lora_adapter."""
        try:
            registry().remove(body.lora_name)
        except UnknownAdapter:
            raise OpenAIError(404, f"no LoRA adapter `{body.lora_name}` is loaded", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
