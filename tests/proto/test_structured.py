"""What a structured-output constraint means (proto/structured.py): each kind becomes one llguidance grammar, and
a constraint that cannot be enforced is told apart at the door, with llguidance's reason; after a reasoning
parser's `</think>` the constraint holds for the answer only."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from proto.structured import after_reasoning, grammar_error, grammar_of
from proto.wire import StructuredOutput
from tests.support.stand_in import tokenizer

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


@pytest.mark.parametrize(
    "structured, answers, refused",
    [
        (StructuredOutput("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"], "additionalProperties": False})),
         ['{"a": 5}'], ['{"a":5}', '{"b": 1}']),  # json.dumps's layout, as without reasoning
        (StructuredOutput("json_object", ""), ['{"x": [1]}'], ["[1]"]),
        (StructuredOutput("regex", "a/[0-9]{2}"), ["a/12"], ["a/1x"]),
        (StructuredOutput("choice", json.dumps(["yes", 'no "way"'])), ["yes", 'no "way"'], ["maybe"]),
    ],
)  # fmt: skip
def test_after_reasoning_the_constraint_holds_for_the_answer(
    structured: StructuredOutput, answers: list[str], refused: list[str]
) -> None:
    wrapped = after_reasoning(structured, "</think>")
    assert grammar_error(wrapped) == ""
    vocab = tokenizer().grammar_tokenizer
    for answer in answers:  # the reasoning is free text (even a partial end tag); the answer is constrained
        assert accepts(wrapped, "<think>a { b\n</thin</think>" + answer, vocab), answer
    for answer in refused:
        assert not accepts(wrapped, "<think>x</think>" + answer, vocab), answer
    assert not accepts(wrapped, answers[0], vocab), "no reasoning end, no answer"
    opened = after_reasoning(structured, "</think>", "<think>")  # a model that opens its reasoning itself
    assert accepts(opened, "<think></think>" + answers[0], vocab) and not accepts(
        opened, "</think>" + answers[0], vocab
    )


def accepts(structured: StructuredOutput, text: str, tokenizer: LLTokenizer) -> bool:
    matcher = LLMatcher(tokenizer, grammar_of(structured))
    ids = tokenizer.tokenize_str(text)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
