"""Tool calling on /v1/chat/completions with the official `openai` client: a scripted stand-in model writes the
calls (a tiny random model would not), the door reads them with `--tool-call-parser` into `tool_calls`, whole and
streamed (id and name first, arguments in pieces, never part of a call in `content`), and sends the conversation
back through the template; bad tools and choices are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from scheduler_node.engine.core import EngineCore
from tests.support.openai_door import MODEL, openai_client
from tests.support.stand_in import ScriptedWorkers, running, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK: Any = {"type": "function", "function": {"name": "get_time"}}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'

Scenario = Callable[[openai.AsyncOpenAI, httpx.AsyncClient], Awaitable[None]]


def scripted(text: str) -> EngineCore:
    """An engine whose model answers `text` to every request."""
    tok = tokenizer()
    return stand_in_engine(workers=ScriptedWorkers(tok.encode(text, False), min(tok.eos_token_ids)))


def serve(engine: EngineCore, scenario: Scenario, parser: str = "hermes", reasoning: str = "") -> None:
    async def main() -> None:
        async with (
            running(engine),
            openai_client(engine, tokenizer(), tool_call_parser=parser, reasoning_parser=reasoning) as (client, raw),
        ):
            await scenario(client, raw)

    asyncio.run(main())


async def streamed(client: openai.AsyncOpenAI, **body: Any) -> tuple[str, dict[int, dict[str, str]], list[str]]:
    """A streamed chat's content, its calls by index (id, name, arguments joined), and its finish reasons."""
    content, calls, reasons = "", {}, []
    stream = await client.chat.completions.create(model=MODEL, stream=True, **body)
    async for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            assert call.function is not None
            if call.index not in calls:  # the first delta of a call names it
                assert call.id and call.function.name and call.type == "function", call
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and not call.function.name, call
            calls[call.index]["arguments"] += call.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    return content, calls, reasons


def called(message: Any) -> list[tuple[str, Any]]:
    """A message's calls: (name, parsed arguments)."""
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("parser, text", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_auto_reads_the_calls_whole_and_streamed(parser: str, text: str) -> None:
    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK])
        (choice,) = answer.choices
        calls = choice.message.tool_calls or []
        assert called(choice.message) == [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {}),
        ]
        assert choice.finish_reason == "tool_calls" and len({c.id for c in calls}) == 2
        assert choice.message.content == ("Let me look." if parser == "hermes" else None)
        content, streamed_calls, reasons = await streamed(client, messages=ASK, tools=[WEATHER, CLOCK])
        assert content.strip() == (choice.message.content or "") and "{" not in content and "<" not in content
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls.values()] == [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {}),
        ]
        assert reasons == ["tool_calls"]
        one = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                   parallel_tool_calls=False)  # fmt: skip
        assert called(one.choices[0].message) == [("get_weather", {"city": "Paris"})]

    serve(scripted(text), scenario, parser)


def test_plain_text_under_auto_is_content_and_none_reads_no_calls() -> None:
    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        assert answer.choices[0].message.content == "It is sunny <b>today</b>."
        assert not answer.choices[0].message.tool_calls and answer.choices[0].finish_reason == "stop"
        content, calls, reasons = await streamed(client, messages=ASK, tools=[WEATHER])
        assert (content, calls, reasons) == ("It is sunny <b>today</b>.", {}, ["stop"])

    serve(scripted("It is sunny <b>today</b>."), scenario)

    async def none(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
        assert answer.choices[0].message.content == HERMES and not answer.choices[0].message.tool_calls

    serve(scripted(HERMES), none)


def test_a_two_turn_conversation_sends_the_calls_and_results_back_through_the_template() -> None:
    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        first = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        message = first.choices[0].message
        (call, _) = message.tool_calls or []
        history: Any = [*ASK, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]  # fmt: skip
        second = await client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
        assert second.choices[0].finish_reason == "tool_calls"
        assert second.usage is not None and first.usage is not None
        assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the calls and the result are in the prompt

    serve(scripted(HERMES), scenario)


def test_bad_tools_and_choices_are_400s_naming_the_field() -> None:
    bad_schema = {**WEATHER["function"], "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": bad_schema}], "tool_choice": "required"},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
          "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
          "function": {"name": "f", "arguments": "[" * 30_000 + "]" * 30_000}}]}]},
         "messages[0].tool_calls[0].function.arguments"),  # deeper than Python's parser recurses: was a 500
    ]  # fmt: skip

    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        for change, param in cases:
            bad = await raw.post("/chat/completions", json={"messages": ASK, **change})
            error = bad.json()["error"]
            assert (bad.status_code, error["param"]) == (400, param), (change, error)
        ok = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        assert ok.choices[0].message.tool_calls  # the server is still up

    serve(scripted(HERMES), scenario)


def test_reasoning_comes_apart_from_the_answer_and_its_calls() -> None:
    thought = "<think>The user wants <tool_call> weather.</think>\n\n"

    async def scenario(client: openai.AsyncOpenAI, raw: httpx.AsyncClient) -> None:
        answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK])
        message: Any = answer.choices[0].message
        assert message.reasoning_content == "The user wants <tool_call> weather."
        assert message.content == "Let me look." and len(called(message)) == 2
        reasoning = ""
        stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
        async for chunk in stream:
            delta: Any = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            assert "think>" not in (delta.content or "")
        assert reasoning == message.reasoning_content
        plain = await client.chat.completions.create(model=MODEL, messages=ASK)  # no tools: the answer is content
        assert plain.choices[0].message.content == HERMES
        assert getattr(plain.choices[0].message, "reasoning_content", None) == message.reasoning_content

    serve(scripted(thought + HERMES), scenario, reasoning="qwen3")
