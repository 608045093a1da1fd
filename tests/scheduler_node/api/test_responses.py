"""POST /v1/responses with the official client's `responses.create`, streaming and not: text from a string or
messages, function calls as output items (and sent back as input items), the typed stream events, usage with
cached tokens, and what a stateless server refuses (store: true, previous_response_id) naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from scheduler_node.api.openai_responses import Usage
from scheduler_node.api.responses_request import ResponsesRequest
from scheduler_node.api.responses_shape import ResponseBuilder
from scheduler_node.engine.core import EngineCore
from tests.support.openai_door import MODEL, openai_client
from tests.support.stand_in import ScriptedWorkers, running, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit

TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
Scenario = Callable[[openai.AsyncOpenAI, httpx.AsyncClient], Awaitable[None]]


def serve(text: str, scenario: Scenario, reasoning_parser: str = "") -> None:
    tok = tokenizer()
    engine: EngineCore = stand_in_engine(workers=ScriptedWorkers(tok.encode(text, False), min(tok.eos_token_ids)))

    async def main() -> None:
        async with running(engine), openai_client(engine, tok, reasoning_parser=reasoning_parser) as (client, raw):
            await scenario(client, raw)

    asyncio.run(main())


def test_text_whole_and_streamed() -> None:
    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        answer = await client.responses.create(model=MODEL, input="Say hello", instructions="Be brief.")
        assert answer.output_text == "Hello there." and answer.status == "completed" and answer.object == "response"
        assert (
            answer.usage is not None
            and answer.usage.output_tokens == len(tokenizer().encode("Hello there.", False)) + 1
        )
        again = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "Say hello"}],
                                              instructions="Be brief.", max_output_tokens=2)  # fmt: skip
        assert again.status == "incomplete" and again.incomplete_details is not None
        assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0  # the same prompt
        kinds, deltas, final = [], "", None
        async for event in await client.responses.create(model=MODEL, input="Say hello", stream=True):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
            if event.type == "response.completed":
                final = event.response
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]  # fmt: skip
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"]  # fmt: skip
        assert deltas == "Hello there." and final is not None and final.output_text == deltas

    serve("Hello there.", scenario)


def test_function_calls_come_out_as_items_and_go_back_in() -> None:
    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        answer = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL])
        message, call = answer.output
        assert message.type == "message" and answer.output_text == "Checking."
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
        history: Any = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]  # fmt: skip
        second = await client.responses.create(model=MODEL, input=history, tools=[TOOL])
        assert second.usage is not None and answer.usage is not None
        assert second.usage.input_tokens > answer.usage.input_tokens
        arguments, items = "", []
        async for event in await client.responses.create(model=MODEL, input="Weather?", tools=[TOOL], stream=True):
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
            if event.type == "response.output_item.done":
                items.append(event.item.type)
        assert json.loads(arguments) == {"city": "Paris"} and items == ["message", "function_call"]

    serve(CALL, scenario)


def test_reasoning_is_an_item_before_the_answer() -> None:
    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        answer = await client.responses.create(model=MODEL, input="Weather?", tools=[TOOL])
        thought, message, call = answer.output
        assert thought.type == "reasoning" and thought.content is not None
        assert thought.content[0].text == "Paris, then." and answer.output_text == "Checking."
        assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
        kinds, reasoning = [], ""
        async for event in await client.responses.create(model=MODEL, input="Weather?", tools=[TOOL], stream=True):
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                reasoning += event.delta
        assert reasoning == "Paris, then." and kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta"
        )

    serve("<think>Paris, then.</think>" + CALL, scenario, reasoning_parser="qwen3")


def test_what_a_stateless_server_refuses_names_the_field() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.function.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ]

    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        for change, param in cases:
            bad = await raw.post("/responses", json={"model": MODEL, "input": "hi", **change})
            error = bad.json()["error"]
            assert (bad.status_code, error["param"]) == (400, param), (change, error)
            assert error["message"].startswith(param), error
        assert (await client.responses.create(model=MODEL, input="hi", store=False)).output_text == "ok"

    serve("ok", scenario)


def test_input_items_become_the_chat_they_mean() -> None:
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ], "instructions": "Hi."})  # fmt: skip
    chat = body.as_chat()
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Hi."), ("system", "Be brief."), ("user", "Weather?"), ("assistant", ""), ("tool", "sunny")
    ]  # fmt: skip
    assert [c.function.name for c in chat.messages[3].tool_calls or []] == ["f", "g"]
    assert chat.messages[4].tool_call_id == "c1"


def test_stream_events_are_numbered_in_order() -> None:
    builder = ResponseBuilder(ResponsesRequest.model_validate({"input": "hi"}), MODEL)
    events = [*builder.text("a"), *builder.text("b"), *builder.finish("stop", Usage(3, 2))]
    data = [json.loads(e.split("\ndata: ", 1)[1]) for e in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(e.startswith(f"event: {d['type']}\n") for e, d in zip(events, data))
    assert data[-1]["response"]["output"][0]["content"][0]["text"] == "ab"
