from __future__ import annotations

import random
from pathlib import Path

import pytest

from scheduler_node.text.detokenizer import IncrementalDetokenizer
from scheduler_node.text.tokenizer import ModelTokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(smollm2_dir)


def stream(tok: ModelTokenizer, text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"), stop)
    deltas = []
    for i, token in enumerate(ids):
        detok.add([token])
        deltas.append(detok.delta(final=detok.stopped or i == len(ids) - 1))
        if detok.stopped:
            break
    return deltas, detok


def test_multibyte_characters_are_never_split(tok: ModelTokenizer) -> None:
    text = "Grüße aus 日本語, emoji 🎉🚀 and more: ñ, ø, 한국어."
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the text must contain tokens that split characters"
    deltas, _ = stream(tok, text, [])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_is_cut_exactly_even_across_tokens(tok: ModelTokenizer) -> None:
    text = "alpha beta gamma delta epsilon"
    deltas, detok = stream(tok, text, ["ma del"])
    assert detok.stopped
    assert "".join(deltas) == "alpha beta gam"


def test_held_back_text_is_released_when_no_stop_matches(tok: ModelTokenizer) -> None:
    deltas, detok = stream(tok, "one two three", ["zzz-not-there"])
    assert not detok.stopped
    assert "".join(deltas) == "one two three"


def test_streamed_text_is_the_decoded_text_for_any_tokens(tok: ModelTokenizer) -> None:
    """Random tokens (special ones, partial characters, a cut mid-character at the end): the deltas add up to the
    tokenizer's own decoding of the whole output after the prompt's context."""
    rng = random.Random(7)
    context = tok.encode("Prompt:")
    split = tok.encode("Grüße 🎉🚀 日本語", add_special_tokens=False)
    cases = [split[:k] for k in range(1, len(split) + 1)]  # every cut, mid-character ones included
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))] for _ in range(50)]
    for ids in cases:
        detok = IncrementalDetokenizer(tok, context, [])
        text = ""
        for i, token in enumerate(ids):
            detok.add([token])
            text += detok.delta(final=i == len(ids) - 1)
        assert text == tok.decode(context + ids)[len(tok.decode(context)) :], ids
