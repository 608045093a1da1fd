"""The official `openai` client on the OpenAI door's app in this process (httpx's ASGI transport: no socket)."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai

from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, build_app
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.metrics import Metrics
from scheduler_node.text.tokenizer import ModelTokenizer

MODEL = "tiny"
# The httpx the openai package is built on (its 3.x releases moved to the httpx2 fork).
CLIENT_HTTPX: Any = importlib.import_module("httpx2") if importlib.util.find_spec("httpx2") else httpx


@asynccontextmanager
async def openai_client(
    engine: EngineCore, tokenizer: ModelTokenizer, **config: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    """An AsyncOpenAI client and a raw httpx client of a door over `engine` (whose loop the caller runs);
    `config`: OpenAIConfig's options (tool_call_parser, reasoning_parser, embedding_pooling)."""
    door = OpenAIDoor(OpenAIConfig("127.0.0.1", 0, MODEL, **config), tokenizer, Metrics(MODEL))
    door.engine = engine
    app = build_app(door)
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://door/v1") as raw,
        CLIENT_HTTPX.AsyncClient(transport=CLIENT_HTTPX.ASGITransport(app=app)) as own,
    ):
        yield openai.AsyncOpenAI(base_url="http://door/v1", api_key="none", http_client=own, max_retries=0), raw
