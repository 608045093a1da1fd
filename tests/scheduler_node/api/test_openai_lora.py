"""LoRA through the OpenAI door: adapters loaded and unloaded at run time behind the API key, listed with their
parent, named by `model`; an unloaded adapter is a 404 while the base model keeps answering."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from proto.lora import BaseShapes
from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, build_app
from scheduler_node.engine.lora_registry import LoraRegistry
from scheduler_node.engine.metrics import Metrics
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.engine import EngineRun, load_runner
from tests.support.lora import make_adapter

pytestmark = pytest.mark.model

MODEL, KEY = "tiny", "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_load_use_and_unload_an_adapter(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama_dir, tmp_path / "a", seed=5, rank=8, gain=3.0)
    with EngineRun(load_runner(tiny_llama_dir, 64, 16), tokenizer_dir=tiny_llama_dir, max_loras=2) as run:
        run.engine.loras = LoraRegistry(BaseShapes.from_folder(tiny_llama_dir), max_rank=8)
        door = OpenAIDoor(OpenAIConfig("127.0.0.1", 0, MODEL, KEY), ModelTokenizer(tiny_llama_dir), Metrics(MODEL))
        door.engine = run.engine
        transport = httpx.ASGITransport(app=build_app(door))

        async def scenario() -> None:
            async with httpx.AsyncClient(transport=transport, base_url="http://door", headers=AUTH) as http:
                await _scenario(http, str(adapter))

        run.serve(scenario)


async def _complete(http: httpx.AsyncClient, model: str) -> httpx.Response:
    body: Any = {"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0}
    return await http.post("/v1/completions", json=body)


async def _scenario(http: httpx.AsyncClient, adapter: str) -> None:
    load = {"lora_name": "sql", "lora_path": adapter}
    assert (
        await http.post("/v1/load_lora_adapter", json=load, headers={"Authorization": "Bearer x"})
    ).status_code == 401
    bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert (await _complete(http, "sql")).status_code == 404  # not loaded yet
    assert (await http.post("/v1/load_lora_adapter", json=load)).status_code == 200
    again = await http.post("/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
    cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
    assert cards["sql"]["parent"] == MODEL and MODEL in cards

    base, tuned = await asyncio.gather(_complete(http, MODEL), _complete(http, "sql"))  # one batch
    assert base.status_code == tuned.status_code == 200
    assert tuned.json()["model"] == "sql"
    assert tuned.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]

    assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 200
    gone = await _complete(http, "sql")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 404
    assert (await _complete(http, MODEL)).json()["choices"][0]["text"] == base.json()["choices"][0]["text"]
