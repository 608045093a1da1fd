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
    return LLMatcher.grammar_from_regex("|".join(_literal(c) for c in json.loads(structured.spec)))


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
