"""What a structured-output constraint means, shared by the scheduler (which validates it at the door) and the
worker (which enforces it token by token): one llguidance grammar per StructuredOutput.

llguidance, not xgrammar: xgrammar imports torch and transformers, so the scheduler (never torch) could not check
a schema with the engine that enforces it; llguidance imports neither (scripts/bench_grammar.py, docs/benchmarks.md).
"""

from __future__ import annotations

import json

from llguidance import LLMatcher, LLTokenizer

from proto.wire import StructuredOutput

# Any JSON object (OpenAI's response_format {"type": "json_object"}).
_ANY_OBJECT = '{"type": "object"}'
# JSON comes out in json.dumps's layout: ", " and ": " and no other whitespace, so a model cannot wander into
# endless whitespace (a schema's own "x-guidance" options override this).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(structured: StructuredOutput) -> str:
    """The llguidance grammar that accepts exactly the texts `structured` allows. ValueError: malformed JSON."""
    if structured.kind == "json":
        return LLMatcher.grammar_from_json_schema(structured.spec, defaults=_JSON_LAYOUT)  # type: ignore[arg-type]
    if structured.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_LAYOUT)  # type: ignore[arg-type]
    if structured.kind == "regex":
        return LLMatcher.grammar_from_regex(structured.spec)
    if structured.kind == "lark":
        return LLMatcher.grammar_from_lark(structured.spec)
    return LLMatcher.grammar_from_regex("|".join(_literal(c) for c in json.loads(structured.spec)))


def after_reasoning(structured: StructuredOutput, end: str, start: str = "") -> StructuredOutput:
    """`structured` applied to the answer after the model's reasoning: `start` (`<think>`; "" where the chat
    template opened it), free text up to and including `end` (`</think>`), then exactly what `structured` allows."""
    if structured.kind in ("json", "json_object"):
        schema = json.loads(structured.spec) if structured.kind == "json" else json.loads(_ANY_OBJECT)
        if isinstance(schema, dict):
            schema.setdefault("x-guidance", _JSON_LAYOUT)
        answer = f"%json {json.dumps(schema)}"
    elif structured.kind == "regex":
        answer = "/" + structured.spec.replace("/", "\\/") + "/"
    elif structured.kind == "choice":
        answer = " | ".join(json.dumps(c) for c in json.loads(structured.spec))
    else:
        answer = f"%lark {{\n{structured.spec}\n}}"
    opening = f"{json.dumps(start)} " if start else ""
    grammar = f"start: {opening}reasoning answer\nreasoning[stop={json.dumps(end)}]: /(?s:.*)/\nanswer: {answer}\n"
    return StructuredOutput("lark", grammar)


def grammar_error(structured: StructuredOutput, tokenizer: LLTokenizer | None = None) -> str:
    """Why `structured` cannot be enforced ("" when it can)."""
    try:
        grammar = grammar_of(structured)
    except ValueError as exc:
        return str(exc)
    return LLMatcher.validate_grammar(grammar, tokenizer)


def _literal(text: str) -> str:
    """`text` as a regex that matches it literally (llguidance's regex syntax is Rust's `regex`)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)
