"""Tool calls in a model's output text: which part is content, which parts are calls (a name and its arguments'
JSON text), as the text grows. `--tool-call-parser` picks one for `tool_choice: auto`: `hermes` (Hermes / Qwen
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `llama3_json` (Llama 3's `{"name": ...,
"parameters": {...}}` calls separated by `;`), or `module:Class`, a subclass of ToolParser built without arguments.

A parser has one method, `scan(text, final)`, over the whole text so far; a stream (api/tool_stream.py) sends what
changed since the last scan. So a scan must only grow: the content it shows and each call's arguments text are
prefixes of what a later scan shows, and a name appears once complete. Text that may still become a call's start
(`<tool_c`) is held back until it is known.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from settings.plugins import load_subclass

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(slots=True)
class PartialCall:
    name: str | None  # None until its string is complete
    arguments: str  # the arguments' JSON text so far (all of it once `done`)
    done: bool = False  # the call's JSON object is complete


@dataclass(slots=True)
class Scan:
    content: str  # the text outside calls that is safe to show
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """Subclass and implement `scan`; name the subclass as `--tool-call-parser module:Class`."""

    def scan(self, text: str, final: bool) -> Scan:
        """The content and calls in `text`, the output so far (`final`: the output ended)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number; content is the text before the first."""

    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.START)
        if first < 0:
            return Scan(text if final else held_back(text, self.START))
        calls, at = [], first
        while at >= 0:
            body = at + len(self.START)
            end = text.find(self.END, body)
            call = partial_call(text[body : end if end >= 0 else len(text)])
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            at = text.find(self.START, end)
        return Scan(text[:first], calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON calls: an output that starts with `{` (after `<|python_tag|>` when the tokenizer keeps it)
    is `{"name": "f", "parameters": {...}}` objects separated by `;`; any other output is content."""

    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        start = len(text) - len(text.lstrip())
        if text.startswith(self.TAG, start):
            start = len(text) - len(text[start + len(self.TAG) :].lstrip())
        rest = text[start:]
        if not rest.startswith("{"):
            undecided = not final and (not rest or self.TAG.startswith(rest))
            return Scan("" if undecided else text)
        return Scan("", call_objects(text, start, ";"))


class JsonArrayToolParser(ToolParser):
    """`tool_choice: required`: the output is the structured-output engine's `[{"name": ..., "parameters": ...}]`."""

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find("[")
        return Scan("", [] if start < 0 else call_objects(text, start + 1, ","))


class NamedToolParser(ToolParser):
    """`tool_choice` naming a function: the whole output is that function's arguments object."""

    def __init__(self, name: str) -> None:
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        arguments = text.lstrip()
        try:
            _, end = _DECODER.raw_decode(arguments)
        except json.JSONDecodeError:
            return Scan("", [PartialCall(self.name, arguments)])
        return Scan("", [PartialCall(self.name, arguments[:end], done=True)])


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def tool_parser_class(name: str) -> type[ToolParser]:
    """A built-in parser by name, or a user's `module:Class` (a subclass of ToolParser); ValueError otherwise."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]
    if ":" in name:
        return load_subclass(name, ToolParser, "tool call parser")
    raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)} or module:Class")


def held_back(text: str, start: str) -> str:
    """`text` less its end where that end could begin `start` (it may become a call)."""
    for keep in range(min(len(start) - 1, len(text)), 0, -1):
        if start.startswith(text[-keep:]):
            return text[:-keep]
    return text


def call_objects(text: str, at: int, separator: str) -> list[PartialCall]:
    """The call objects from `at` on, separated by `separator` and whitespace; the last may be incomplete."""
    calls: list[PartialCall] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == separator):
            at += 1
        if not text.startswith("{", at):
            return calls
        try:
            _, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            call = partial_call(text[at:])
            return calls + ([call] if call is not None else [])
        call = partial_call(text[at:end])
        if call is not None:
            calls.append(call)
        at = end


def partial_call(body: str) -> PartialCall | None:
    """One call's `{"name": ..., "arguments": {...}}` text, maybe incomplete (None: not a call object). The name
    and the arguments are streamed only when the name comes first: then the arguments' text so far is a prefix of
    their final text (a value not yet closed holds every character after its key)."""
    body = body.strip()
    if not body.startswith("{"):
        return None
    try:
        whole, _ = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        whole = None
    name_at, arguments_at = _NAME.search(body), _ARGUMENTS.search(body)
    if isinstance(whole, dict):
        return _complete(body, whole, arguments_at)
    if name_at is None or (arguments_at is not None and arguments_at.start() < name_at.start()):
        return PartialCall(None, "")
    name = json.loads(f'"{name_at.group(1)}"')
    if arguments_at is None:
        return PartialCall(name, "")
    return PartialCall(name, _arguments_text(body, arguments_at.end()))


def _complete(body: str, whole: dict[str, object], arguments_at: re.Match[str] | None) -> PartialCall | None:
    name = whole.get("name")
    if not isinstance(name, str):
        return None
    arguments = whole.get("arguments", whole.get("parameters", {}))
    if arguments_at is not None:
        return PartialCall(name, _arguments_text(body, arguments_at.end()), done=True)
    return PartialCall(name, json.dumps(arguments, ensure_ascii=False), done=True)


def _arguments_text(body: str, at: int) -> str:
    try:
        _, end = _DECODER.raw_decode(body, at)
    except json.JSONDecodeError:
        return body[at:]
    return body[at:end]
