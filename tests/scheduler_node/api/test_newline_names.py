"""A name that ends in a newline is not the name: Python's `$` matches before a final newline, so a check written
`^...$` with `match` let "get_weather\\n" through. Each place a client names something refuses it: tools (chat and
Responses), the model, a LoRA adapter to load (HTTP and gRPC)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from proto import serving_pb2 as pb
from proto.lora import BaseShapes
from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, build_app
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.lora_registry import LoraRegistry
from scheduler_node.engine.metrics import Metrics
from tests.scheduler_node.api.test_grpc_server import TOKEN_HEADER, Door, status_of
from tests.scheduler_node.api.test_grpc_server import serve as serve_grpc
from tests.support.lora import write_adapter
from tests.support.stand_in import running, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny"
BASE = BaseShapes(hidden=16, q_size=16, kv_size=8, intermediate=32, num_layers=2)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_NL: Any = {"type": "function", "function": {"name": "get_weather\n"}}


def with_loras() -> EngineCore:
    engine = stand_in_engine()
    engine.loras = LoraRegistry(BASE, max_rank=8, base_name=MODEL)
    return engine


def post_all(engine: EngineCore, requests: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """Each (path, body) posted in turn to an OpenAI door over `engine`, its loop running."""

    async def main() -> list[httpx.Response]:
        door = OpenAIDoor(OpenAIConfig("127.0.0.1", 0, MODEL), tokenizer(), Metrics(MODEL))
        door.engine = engine
        transport = httpx.ASGITransport(app=build_app(door))
        async with running(engine), httpx.AsyncClient(transport=transport, base_url="http://door") as http:
            return [await http.post(path, json=body) for path, body in requests]

    return asyncio.run(main())


def test_tool_and_model_names_ending_in_a_newline_are_refused() -> None:
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER_NL]}, 400, "tools[0].function.name"),
        ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "get_weather\n"}]}, 400,
         "tools[0].function.name"),
        ("/v1/completions", {"model": MODEL + "\n", "prompt": "hi", "max_tokens": 1}, 404, "model"),
    ]  # fmt: skip
    answers = post_all(stand_in_engine(), [(path, body) for path, body, _, _ in cases])
    for (path, _, status, param), answer in zip(cases, answers):
        assert answer.status_code == status, (path, answer.text)
        assert answer.json()["error"]["param"] == param, (path, answer.text)


def test_a_lora_name_ending_in_a_newline_is_refused_over_http(tmp_path: Path) -> None:
    adapter = str(write_adapter(tmp_path / "x", BASE))
    (answer,) = post_all(with_loras(), [("/v1/load_lora_adapter", {"lora_name": "x\n", "lora_path": adapter})])
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora_name", answer.text


def test_a_lora_name_ending_in_a_newline_is_refused_over_grpc(tmp_path: Path) -> None:
    load = pb.LoadLoraAdapterRequest(lora_name="x\n", lora_path=str(write_adapter(tmp_path / "x", BASE)))

    async def scenario(d: Door) -> None:
        code, detail = await status_of(d.control.LoadLoraAdapter(load, metadata=TOKEN_HEADER))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and detail.startswith("lora_name"), detail

    serve_grpc(with_loras(), scenario, control_token="s3cret")
