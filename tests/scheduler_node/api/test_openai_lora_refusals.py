"""`POST /v1/load_lora_adapter` refuses what cannot be served with a 400 naming the field, tensor or key, never a
500 and never a 200 for an adapter that would spoil other tenants' answers: NaN weights or scale, a safetensors
header entry that is not an object, a name with a newline after it."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest

from proto.lora import BaseShapes
from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, build_app
from scheduler_node.engine.lora_registry import LoraRegistry
from scheduler_node.engine.metrics import Metrics
from tests.support.lora import poison, write_adapter
from tests.support.stand_in import stand_in_engine, tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny"
BASE = BaseShapes(hidden=64, q_size=64, kv_size=32, intermediate=128, num_layers=2)
A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _load(body: dict[str, Any]) -> httpx.Response:
    """The load route's answer on a door over an engine with LoRA on (stand-in workers: nothing runs)."""

    async def main() -> httpx.Response:
        engine = stand_in_engine()
        engine.loras = LoraRegistry(BASE, max_rank=8, base_name=MODEL)
        door = OpenAIDoor(OpenAIConfig("127.0.0.1", 0, MODEL), tokenizer(), Metrics(MODEL))
        door.engine = engine
        transport = httpx.ASGITransport(app=build_app(door), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as http:
            return await http.post("/v1/load_lora_adapter", json=body)

    return asyncio.run(main())


def _header_of_a_non_object(folder: Path) -> Path:
    text = json.dumps({A0: 5}).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    return folder


def _nan_alpha(folder: Path) -> Path:
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}')
    return folder


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda f: poison(f, "A"), "q_proj.lora_A.weight: 256 of its 256 values are NaN or infinite"),
        (lambda f: poison(f, "B", float("inf")), "q_proj.lora_B.weight: 256 of its 256 values are NaN or infinite"),
        (_nan_alpha, "lora_alpha must be a finite number > 0, got nan"),
        (_header_of_a_non_object, f"tensor {A0}: its header entry is 5, not an object"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_a_400_naming_why(tmp_path: Path, damage: Any, words: str) -> None:
    folder = damage(write_adapter(tmp_path / "a", BASE, seed=1))
    answer = _load({"lora_name": "bad", "lora_path": str(folder)})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "lora_path" and words in error["message"], error


def test_a_name_with_a_newline_is_a_400(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", BASE, seed=1)
    answer = _load({"lora_name": "x\n", "lora_path": str(folder)})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora_name", answer.text
    assert _load({"lora_name": "x", "lora_path": str(folder)}).status_code == 200
