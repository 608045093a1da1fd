"""Agent frameworks as real clients of the door: LangChain's `ChatOpenAI(...).bind_tools(...)` gets the model's
tool call back as `tool_calls`, streams them, and sends the tool's result back in a second turn; its
`with_structured_output` extraction returns the parsed object; `instructor` extracts a pydantic model through its
default tool-calling mode and its JSON-schema mode, streamed partial objects included."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import instructor
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, SecretStr

from scheduler_node.engine.core import EngineCore
from tests.support.openai_door import CLIENT_HTTPX, MODEL, openai_client
from tests.support.stand_in import ScriptedWorkers, running, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str


CALL = '<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Paris"}}\n</tool_call>'


def scripted(text: str) -> EngineCore:
    tok = tokenizer()
    return stand_in_engine(workers=ScriptedWorkers(tok.encode(text, False), min(tok.eos_token_ids)))


def serve(text: str, scenario: Callable[[ChatOpenAI], Awaitable[None]]) -> None:
    engine = scripted(text)

    async def main() -> None:
        async with running(engine), openai_client(engine, tokenizer()) as (client, _):
            http: Any = client._client  # the door's ASGI transport, as langchain's async client
            assert isinstance(http, CLIENT_HTTPX.AsyncClient)
            chat = ChatOpenAI(model=MODEL, base_url="http://door/v1", api_key=SecretStr("none"),
                              http_async_client=http, max_retries=0, temperature=0)  # fmt: skip
            await scenario(chat)

    asyncio.run(main())


def test_langchain_bind_tools_round_trip() -> None:
    async def scenario(chat: ChatOpenAI) -> None:
        agent = chat.bind_tools([GetWeather])
        ask = [HumanMessage("Weather in Paris?")]
        reply = await agent.ainvoke(ask)
        (call,) = reply.tool_calls  # type: ignore[attr-defined]
        assert (call["name"], call["args"]) == ("GetWeather", {"city": "Paris"}) and call["id"]
        chunks: Any = None
        async for chunk in agent.astream(ask):
            assert isinstance(chunk, AIMessageChunk)
            chunks = chunk if chunks is None else chunks + chunk
        assert [(c["name"], c["args"]) for c in chunks.tool_calls] == [("GetWeather", {"city": "Paris"})]
        second = await agent.ainvoke([*ask, reply, ToolMessage("sunny", tool_call_id=call["id"])])
        assert second.tool_calls  # type: ignore[attr-defined]  # the scripted model calls again: the history went through

    serve(CALL, scenario)


def test_langchain_structured_extraction() -> None:
    async def scenario(chat: ChatOpenAI) -> None:
        extract = chat.with_structured_output(GetWeather, method="function_calling")
        assert await extract.ainvoke("It is sunny in Paris.") == GetWeather(city="Paris")

    serve('{"city": "Paris"}', scenario)  # a named tool_choice: the output is the arguments


def ask_instructor(text: str, scenario: Callable[[AsyncOpenAI], Awaitable[None]]) -> None:
    engine = scripted(text)

    async def main() -> None:
        async with running(engine), openai_client(engine, tokenizer()) as (client, _):
            await scenario(client)

    asyncio.run(main())


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_extraction(mode: instructor.Mode) -> None:
    """instructor's default mode sends a named `tool_choice` (the grammar makes the arguments the object); its
    JSON-schema mode sends `response_format: json_schema`; both parse our answer into the model."""

    async def scenario(client: AsyncOpenAI) -> None:
        extract = instructor.from_openai(client, mode=mode)
        ask: list[Any] = [{"role": "user", "content": "It is sunny in Paris."}]
        weather = await extract.chat.completions.create(model=MODEL, response_model=GetWeather, messages=ask,
                                                        max_retries=0, temperature=0)  # fmt: skip
        assert isinstance(weather, GetWeather) and weather.model_dump() == {"city": "Paris"}
        partial = extract.chat.completions.create_partial(model=MODEL, response_model=GetWeather, messages=ask,
                                                          max_retries=0, temperature=0)  # fmt: skip
        last = [p async for p in partial][-1]
        assert last.city == "Paris"

    ask_instructor('{"city": "Paris"}', scenario)
