"""Tool-call parsers and the stream over them: fed a character at a time, the content and the calls' deltas join
to what the whole output parses to; text that may begin a call is held back; a broken call is content."""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import pytest

from scheduler_node.api.tool_parsers import (
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    Scan,
    ToolParser,
    tool_parser_class,
)
from scheduler_node.api.tool_stream import ToolCallStream
from scheduler_node.api.tools import NamedToolChoice, Tool, tool_plan
from scheduler_node.api.validation import InvalidField

pytestmark = pytest.mark.unit

CASES: list[tuple[ToolParser, str, str]] = [
    (HermesToolParser(), 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "}<tool_call>", "b": [1, {}]}}\n'
     '</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Sure."),
    (Llama3JsonToolParser(), ' {"name": "f", "parameters": {"a": "}<tool_call>", "b": [1, {}]}}; '
     '{"name": "g", "parameters": {}}', ""),
    (JsonArrayToolParser(), '[{"name": "f", "parameters": {"a": "}<tool_call>", "b": [1, {}]}}, '
     '{"name": "g", "parameters": {}}]', ""),
]  # fmt: skip
CALLS = [("f", {"a": "}<tool_call>", "b": [1, {}]}), ("g", {})]


def stream(parser: ToolParser, text: str, parallel: bool = True) -> tuple[str, list[tuple[str, Any]]]:
    """The content and calls a stream sends for `text` fed one character at a time."""
    s = ToolCallStream(parser, parallel)
    content, calls = "", {}
    for i, ch in enumerate(text):
        piece, deltas = s.feed(ch, final=i == len(text) - 1)
        content += piece
        for d in deltas:
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["function"]["name"], d  # id and name first
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                assert "id" not in d and "name" not in d["function"], d
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()]


@pytest.mark.parametrize("parser, text, content", CASES)
def test_streamed_and_whole_agree(parser: ToolParser, text: str, content: str) -> None:
    streamed_content, streamed_calls = stream(parser, text)
    assert streamed_content.strip() == content and streamed_calls == CALLS
    whole_content, whole_calls = ToolCallStream(parser).result(text)
    assert whole_content == (content or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls] == CALLS
    assert stream(parser, text, parallel=False)[1] == CALLS[:1]


def test_the_start_of_a_call_is_held_back_until_it_is_known() -> None:
    parser = HermesToolParser()
    assert parser.scan("Hi <tool_c", final=False) == Scan("Hi ")
    assert parser.scan("Hi <tool_c", final=True) == Scan("Hi <tool_c")
    assert stream(parser, "a <tool box> b") == ("a <tool box> b", [])
    assert Llama3JsonToolParser().scan("  ", final=False) == Scan("")
    assert Llama3JsonToolParser().scan("Paris {x}", final=False) == Scan("Paris {x}")


def test_a_broken_or_cut_call_is_content() -> None:
    for text in ('<tool_call>{"name": "f", "arguments": {"a": 1}', "<tool_call>not json</tool_call>"):
        assert ToolCallStream(HermesToolParser()).result(text) == (text, [])
    assert stream(HermesToolParser(), "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_a_named_choice_reads_the_whole_output_as_its_arguments() -> None:
    content, calls = ToolCallStream(NamedToolParser("f")).result('{"a": {"b": 2}}')
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"a": {"b": 2}}']
    assert stream(NamedToolParser("f"), '{"a": {"b": 2}}') == ("", [("f", {"a": {"b": 2}})])


def test_parsers_by_name_or_module_class() -> None:
    assert tool_parser_class("hermes") is HermesToolParser
    module = types.ModuleType("my_parsers")
    module.Mine = type("Mine", (HermesToolParser,), {})  # type: ignore[attr-defined]
    module.NotOne = dict  # type: ignore[attr-defined]
    sys.modules["my_parsers"] = module
    try:
        assert tool_parser_class("my_parsers:Mine") is module.Mine  # type: ignore[attr-defined]
        for bad in ("nope", "my_parsers:NotOne", "my_parsers:Missing", "no_such_module:X"):
            with pytest.raises(ValueError, match="nope|subclass|cannot load tool call parser"):
                tool_parser_class(bad)
    finally:
        del sys.modules["my_parsers"]


def test_a_plan_enforces_required_and_named_choices() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {"name": n}}) for n in ("f", "g")]
    assert tool_plan(None, None, True).mode == "none" and tool_plan(tools, None, True).mode == "auto"
    required = tool_plan(tools, "required", False).structured()
    assert required is not None and isinstance(required.json, dict) and required.json["maxItems"] == 1
    named = tool_plan(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}}), True)
    assert (named.mode, named.name, named.parallel) == ("named", "g", False)
    with pytest.raises(InvalidField, match="no tool named 'h'"):
        tool_plan(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "h"}}), True)
