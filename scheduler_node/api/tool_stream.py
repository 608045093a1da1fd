"""One chat choice's output as content and tool calls in OpenAI's shapes: whole (`result`) or as the text streams
(`feed`: the content that is safe to show, and `tool_calls` deltas — a call's index, id and name first, then its
arguments in pieces — never part of a call in `content`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from proto.nesting import parse_nested
from scheduler_node.api.tool_parsers import PartialCall, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _Sent:
    id: str
    arguments: int = 0  # characters of the arguments sent


@dataclass
class ToolCallStream:
    parser: ToolParser
    parallel: bool = True  # False: the first call only (parallel_tool_calls: false)
    text: str = ""
    content_sent: int = 0
    sent: list[_Sent] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls deltas `text`, the output's next piece, brings (`final`: its last)."""
        self.text += text
        scan = self.parser.scan(self.text, final)
        content = scan.content[self.content_sent :]
        self.content_sent = len(scan.content)
        deltas = []
        for index, call in enumerate(self._calls(scan.calls)):
            delta = self._delta(index, call)
            if delta is None:
                break
            if delta:
                deltas.append(delta)
        if final and not self.sent:  # no call after all: the rest is content (as a whole answer's would be)
            content += self.text[self.content_sent :]
        return content, deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def _calls(self, calls: list[PartialCall]) -> list[PartialCall]:
        return calls if self.parallel else calls[:1]

    def _delta(self, index: int, call: PartialCall) -> dict[str, Any] | None:
        """What is new of call `index` ({} nothing; None: not started, nor are the calls after it)."""
        delta: dict[str, Any] = {}
        if index == len(self.sent):
            if call.name is None:
                return None
            self.sent.append(_Sent(call_id()))
            delta = {"index": index, "id": self.sent[index].id, "type": "function",
                     "function": {"name": call.name, "arguments": ""}}  # fmt: skip
        sent = self.sent[index]
        new = call.arguments[sent.arguments :]
        if new:
            sent.arguments = len(call.arguments)
            delta = delta or {"index": index, "function": {}}
            delta["function"]["arguments"] = new
        return delta

    def result(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output's content (None when it only calls) and its calls; an output with no complete, valid
        call is all content."""
        scan = self.parser.scan(text, final=True)
        calls = [
            {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in self._calls(scan.calls)
            if call.done and call.name and _is_object(call.arguments)
        ]
        if not calls:
            return text, []
        return scan.content.strip() or None, calls


def _is_object(text: str) -> bool:
    try:
        return isinstance(parse_nested(json.loads, text, "arguments"), dict)
    except ValueError:  # not JSON, or nested too deeply to parse
        return False
