"""What a structured-output constraint means (proto/structured.py): each kind becomes one llguidance grammar, and
a constraint that cannot be enforced is told apart at the door, with llguidance's reason."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from proto.structured import grammar_error, grammar_of
from proto.wire import StructuredOutput

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("json", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}})),
        StructuredOutput("json_object", ""),
        StructuredOutput("regex", "[0-9]{3}"),
        StructuredOutput("choice", json.dumps(["yes", "no (maybe)", "a.b*c"])),
    ],
)
def test_every_kind_makes_a_valid_grammar(structured: StructuredOutput) -> None:
    assert grammar_error(structured) == ""
    assert LLMatcher.validate_grammar(grammar_of(structured)) == ""


def test_a_constraint_that_cannot_be_enforced_says_why() -> None:
    assert grammar_error(StructuredOutput("regex", "[0-9")) != ""
    assert grammar_error(StructuredOutput("json", "{not json")) != ""
