"""`tool_choice: required` and a named function are enforced by the structured-output engine: 50 samples at
temperature 1 of a tiny random model (which knows nothing of tools) through the OpenAI door are all calls whose
arguments validate against their function's schema, whole and streamed; with a reasoning parser, a
response_format holds for the answer after the reasoning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.engine import EngineRun, load_runner
from tests.support.openai_door import MODEL, openai_client

pytestmark = pytest.mark.model

SAMPLES = 50
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD: Any = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, ADD)}
ASK: Any = [{"role": "user", "content": "Call a tool."}]


def check(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_and_named_calls_always_validate(tiny_llama_dir: Path) -> None:
    with EngineRun(load_runner(tiny_llama_dir, 256, 16), tokenizer_dir=tiny_llama_dir) as run:

        async def scenario() -> None:
            async with openai_client(run.engine, ModelTokenizer(tiny_llama_dir)) as (client, _):
                body: Any = dict(model=MODEL, messages=ASK, tools=[WEATHER, ADD], temperature=1.0, max_tokens=60)
                required = await client.chat.completions.create(
                    **body, tool_choice="required", parallel_tool_calls=False, n=SAMPLES, seed=1
                )
                named = await client.chat.completions.create(
                    **body, tool_choice={"type": "function", "function": {"name": "add"}}, n=SAMPLES, seed=2
                )
                for answer, names in ((required, set(SCHEMAS)), (named, {"add"})):
                    assert len(answer.choices) == SAMPLES
                    for choice in answer.choices:
                        (call,) = choice.message.tool_calls or []
                        assert call.function.name in names  # type: ignore[union-attr]
                        check(call.function.name, call.function.arguments)  # type: ignore[union-attr]
                        assert choice.finish_reason == "tool_calls" and not choice.message.content
                stream = await client.chat.completions.create(**body, tool_choice="required", n=4, seed=3, stream=True)
                calls: dict[tuple[int, int], list[str]] = {}
                finished: dict[int, str] = {}
                async for chunk in stream:
                    for choice in chunk.choices:
                        for delta in choice.delta.tool_calls or []:
                            assert delta.function is not None
                            parts = calls.setdefault((choice.index, delta.index), [delta.function.name or ""])
                            parts.append(delta.function.arguments or "")
                        if choice.finish_reason:
                            finished[choice.index] = choice.finish_reason
                assert {key[0] for key in calls} == {0, 1, 2, 3}
                for (index, _), (name, *pieces) in calls.items():
                    if finished[index] == "tool_calls":  # parallel calls may run past max_tokens
                        check(name, "".join(pieces))
                assert "tool_calls" in finished.values()

        run.serve(scenario)


def test_with_a_reasoning_parser_the_schema_holds_for_the_answer_after_the_reasoning(tiny_llama_dir: Path) -> None:
    """The reasoning is free text up to `</think>`, the answer after it valid JSON for the schema. A random model
    writes `</think>` only when pushed: its three tokens are favoured (in the reasoning; the JSON masks them)."""
    tokenizer = ModelTokenizer(tiny_llama_dir)
    end_tokens = tokenizer.encode("</think>", add_special_tokens=False)
    with EngineRun(load_runner(tiny_llama_dir, 256, 16), tokenizer_dir=tiny_llama_dir) as run:

        async def scenario() -> None:
            async with openai_client(run.engine, tokenizer, reasoning_parser="qwen3") as (client, _):
                schema = ADD["function"]["parameters"]
                answer = await client.chat.completions.create(
                    model=MODEL, messages=ASK, temperature=1.0, max_tokens=400, n=8, seed=4,
                    logit_bias={str(t): 100 for t in end_tokens},
                    response_format={"type": "json_schema", "json_schema": {"name": "add", "schema": schema}},
                )  # fmt: skip
                for choice in answer.choices:
                    message: Any = choice.message
                    assert choice.finish_reason == "stop" and message.reasoning_content is not None
                    jsonschema.validate(json.loads(message.content), schema)

        run.serve(scenario)
