"""Reasoning parsers: `<think>…</think>` split off the output whole and as it streams (a character at a time, the
same split), held back while the text may still open or close it; with tools, calls are read from the answer."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from scheduler_node.api.chat_output import ChatOutput
from scheduler_node.api.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningScan,
    ReasoningStream,
    reasoning_parser_class,
)
from scheduler_node.api.tool_parsers import HermesToolParser
from scheduler_node.api.tool_stream import ToolCallStream

pytestmark = pytest.mark.unit

CASES: list[tuple[ReasoningParser, str, str | None, str]] = [
    (Qwen3ReasoningParser(), "<think>\nHm, </thin or so.\n</think>\n\nParis.", "\nHm, </thin or so.\n", "Paris."),
    (Qwen3ReasoningParser(), "Paris, <think> no.", None, "Paris, <think> no."),
    (Qwen3ReasoningParser(), "<think>cut short", "cut short", ""),
    (DeepSeekR1ReasoningParser(), "Hm.</think>Paris.", "Hm.", "Paris."),
    (DeepSeekR1ReasoningParser(), "<think>Hm.</think>Paris.", "Hm.", "Paris."),
    (DeepSeekR1ReasoningParser(), "still thinking", "still thinking", ""),
]


def streamed(output: ChatOutput, text: str) -> tuple[str, str, list[dict[str, Any]]]:
    reasoning, content = "", ""
    calls: list[dict[str, Any]] = []
    for i, ch in enumerate(text):
        piece = output.feed(ch, final=i == len(text) - 1)
        reasoning, content, calls = reasoning + piece.reasoning, content + piece.content, calls + piece.tool_calls
    return reasoning, content, calls


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_whole_and_streamed_split_alike(
    parser: ReasoningParser, text: str, reasoning: str | None, content: str
) -> None:
    assert ReasoningStream(parser).result(text) == (reasoning, content)
    got_reasoning, got_content, _ = streamed(ChatOutput(ReasoningStream(parser)), text)
    assert (got_reasoning, got_content.lstrip()) == (reasoning or "", content)


def test_undecided_text_is_held_back() -> None:
    assert Qwen3ReasoningParser().scan("<thi", final=False) == ReasoningScan("", None)
    assert Qwen3ReasoningParser().scan("<thi", final=True) == ReasoningScan("", 0)
    assert Qwen3ReasoningParser().scan("<think>a</thi", final=False) == ReasoningScan("a", None)


def test_tool_calls_are_read_from_the_answer_after_the_reasoning() -> None:
    text = '<think>I need <tool_call> weather.</think><tool_call>{"name": "w", "arguments": {"c": 1}}</tool_call>'

    def output() -> ChatOutput:
        return ChatOutput(ReasoningStream(Qwen3ReasoningParser()), ToolCallStream(HermesToolParser()))

    whole = output().result(text)
    assert whole.reasoning == "I need <tool_call> weather." and whole.content is None
    assert [c["function"]["arguments"] for c in whole.tool_calls] == ['{"c": 1}']
    reasoning, content, calls = streamed(output(), text)
    assert reasoning == whole.reasoning and content == "" and [c["function"].get("name") for c in calls][0] == "w"


def test_parsers_by_name_or_module_class() -> None:
    assert reasoning_parser_class("") is None and reasoning_parser_class("qwen3") is Qwen3ReasoningParser
    module = types.ModuleType("my_reasoning")
    module.Mine = type("Mine", (ReasoningParser,), {"start": "<r>", "end": "</r>"})  # type: ignore[attr-defined]
    sys.modules["my_reasoning"] = module
    try:
        mine = reasoning_parser_class("my_reasoning:Mine")
        assert mine is not None and ReasoningStream(mine()).result("<r>x</r>y") == ("x", "y")
        for bad in ("nope", "my_reasoning:Missing", "dict:x"):
            with pytest.raises(ValueError):
                reasoning_parser_class(bad)
    finally:
        del sys.modules["my_reasoning"]
