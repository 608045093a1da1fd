"""One chat choice's output read as reasoning, content and tool calls: the reasoning parser takes the reasoning
off the front, the tool parser reads calls out of what follows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler_node.api.reasoning_parsers import ReasoningStream
from scheduler_node.api.tool_stream import ToolCallStream


@dataclass(slots=True)
class Piece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Whole:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass
class ChatOutput:
    reasoning: ReasoningStream | None = None
    calls: ToolCallStream | None = None

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, text: str, final: bool) -> Piece:
        """What the output's next piece `text` brings (`final`: its last)."""
        piece = Piece(content=text)
        if self.reasoning is not None:
            piece.reasoning, piece.content = self.reasoning.feed(text, final)
        if self.calls is not None:
            piece.content, piece.tool_calls = self.calls.feed(piece.content, final)
        return piece

    def result(self, text: str) -> Whole:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.result(text)
        if self.calls is None:
            return Whole(reasoning, text, [])
        content, calls = self.calls.result(text)
        return Whole(reasoning, content, calls)
