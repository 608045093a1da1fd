"""The OpenAI door's control routes (loading and unloading LoRA adapters, which read server-side paths): with
--control-token they need `Authorization: Bearer <control token>` and nothing else opens them (not the API key,
not a path the router matches by its trailing `$`); without one they stay behind the API key like every route."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, build_app
from scheduler_node.engine.metrics import Metrics
from tests.support.stand_in import tokenizer

pytestmark = pytest.mark.unit

MODEL, KEY, TOKEN = "tiny", "sk-client", "control-s3cret"
LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


class RecordingRegistry:
    """Stands in for the LoRA registry: what the routes asked of it, so a refused request is seen to change nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def add(self, name: str, path: str) -> None:
        self.calls.append(("add", name, path))

    def remove(self, name: str) -> None:
        self.calls.append(("remove", name))

    def refs(self) -> list[Any]:
        return []


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


Scenario = Callable[[httpx.AsyncClient, RecordingRegistry], Awaitable[None]]


def serve(scenario: Scenario, api_key: str = "", control_token: str = "") -> None:
    """Run `scenario` with a client (no credentials of its own) of a door whose engine has LoRA on."""
    registry = RecordingRegistry()
    config = OpenAIConfig("127.0.0.1", 0, MODEL, api_key=api_key, control_token=control_token)
    door = OpenAIDoor(config, tokenizer(), Metrics(MODEL))
    door.engine = SimpleNamespace(loras=registry, max_model_len=64)  # type: ignore[assignment]

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(door)), base_url="http://door") as c:
            await scenario(c, registry)

    asyncio.run(main())


def test_the_control_token_alone_opens_the_control_routes() -> None:
    async def scenario(http: httpx.AsyncClient, registry: RecordingRegistry) -> None:
        for headers in ({}, bearer("wrong"), {"Authorization": TOKEN}):
            refused = await http.post("/v1/load_lora_adapter", json=LOAD, headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert "--control-token" in refused.json()["error"]["message"]
            assert refused.headers["www-authenticate"] == "Bearer"
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 401
        sneaky = await http.post("/v1/load_lora_adapter%0A", json=LOAD)  # the route's pattern matches it too
        assert sneaky.status_code == 401, sneaky.text
        assert registry.calls == []
        assert (await http.post("/v1/load_lora_adapter", json=LOAD, headers=bearer(TOKEN))).status_code == 200
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=bearer(TOKEN))).is_success
        assert registry.calls == [("add", "sql", "/adapters/sql"), ("remove", "sql")]
        assert (await http.get("/v1/models")).status_code == 200  # no API key: the other routes stay open

    serve(scenario, control_token=TOKEN)


def test_with_an_api_key_too_each_credential_opens_only_its_own_routes() -> None:
    async def scenario(http: httpx.AsyncClient, registry: RecordingRegistry) -> None:
        assert (await http.post("/v1/load_lora_adapter", json=LOAD, headers=bearer(KEY))).status_code == 401
        assert (await http.get("/v1/models", headers=bearer(TOKEN))).status_code == 401
        assert registry.calls == []
        assert (await http.post("/v1/load_lora_adapter", json=LOAD, headers=bearer(TOKEN))).status_code == 200
        assert (await http.get("/v1/models", headers=bearer(KEY))).status_code == 200
        assert (await http.get("/metrics")).status_code == 200  # Prometheus needs neither

    serve(scenario, api_key=KEY, control_token=TOKEN)


def test_without_a_control_token_the_routes_are_behind_the_api_key_or_open() -> None:
    async def keyed(http: httpx.AsyncClient, registry: RecordingRegistry) -> None:
        assert (await http.post("/v1/load_lora_adapter", json=LOAD)).status_code == 401
        assert (await http.post("/v1/load_lora_adapter", json=LOAD, headers=bearer(KEY))).status_code == 200
        assert registry.calls == [("add", "sql", "/adapters/sql")]

    async def open_door(http: httpx.AsyncClient, registry: RecordingRegistry) -> None:
        assert (await http.post("/v1/load_lora_adapter", json=LOAD)).status_code == 200
        assert registry.calls == [("add", "sql", "/adapters/sql")]

    serve(keyed, api_key=KEY)
    serve(open_door)
