"""The model's reasoning in its output: `--reasoning-parser` splits `<think>…</think>` off into `reasoning_content`
(`qwen3`: reasoning only when the output opens with `<think>`; `deepseek_r1`: the template opened it, so the output
is reasoning until `</think>`), or `module:Class`, a subclass of ReasoningParser built without arguments.

As for tool parsers (api/tool_parsers.py), `scan` reads the whole text so far and must only grow: the reasoning it
shows is a prefix of a later scan's, and once content starts it starts at the same place. A constraint on the
output (response_format, a required tool) applies to the content: the grammar lets the reasoning run up to `end`
first (proto/structured.py `after_reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_node.api.tool_parsers import held_back
from settings.plugins import load_subclass


@dataclass(frozen=True, slots=True)
class ReasoningScan:
    reasoning: str  # the reasoning so far that is safe to show
    content_at: int | None  # where the content starts in the text (None: still reasoning, or undecided)


class ReasoningParser:
    start = "<think>"
    end = "</think>"
    opened_by_template = False  # the output starts inside the reasoning (the template wrote `start`)

    def scan(self, text: str, final: bool) -> ReasoningScan:
        at = len(text) - len(text.lstrip())
        if text.startswith(self.start, at):
            at += len(self.start)
        elif not final and self.start.startswith(text[at:]):
            return ReasoningScan("", None)  # it may still open
        elif not self.opened_by_template:
            return ReasoningScan("", 0)  # no reasoning: all content
        else:
            at = 0
        close = text.find(self.end, at)
        if close < 0:
            return ReasoningScan(text[at:] if final else held_back(text[at:], self.end), None)
        return ReasoningScan(text[at:close], close + len(self.end))


class Qwen3ReasoningParser(ReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ReasoningParser):
    opened_by_template = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def reasoning_parser_class(name: str) -> type[ReasoningParser] | None:
    """ "" (off), a built-in parser by name, or a user's `module:Class`; ValueError otherwise."""
    if not name:
        return None
    if name in REASONING_PARSERS:
        return REASONING_PARSERS[name]
    if ":" in name:
        return load_subclass(name, ReasoningParser, "reasoning parser")
    raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)} or module:Class")


@dataclass
class ReasoningStream:
    """One choice's output split into reasoning and content pieces as it streams."""

    parser: ReasoningParser
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content that `piece` brings."""
        self.text += piece
        scan = self.parser.scan(self.text, final)
        reasoning = scan.reasoning[self.reasoning_sent :]
        self.reasoning_sent = len(scan.reasoning)
        if scan.content_at is None:
            return reasoning, ""
        content = self.text[scan.content_at + self.content_sent :]
        self.content_sent += len(content)
        return reasoning, content

    def result(self, text: str) -> tuple[str | None, str]:
        """A whole output's reasoning (None when it has none) and content."""
        scan = self.parser.scan(text, final=True)
        content = text[scan.content_at :] if scan.content_at is not None else ""
        return scan.reasoning or None, content.lstrip() if scan.content_at else content
