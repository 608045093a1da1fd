"""The prompt forms of the Python API: text, token ids, vLLM's dicts; a bad one is named."""

from __future__ import annotations

import pytest

from minivllm.prompts import is_ids, per_prompt, unwrap

pytestmark = pytest.mark.unit


def test_the_forms_unwrap_to_text_or_ids_with_their_names() -> None:
    assert unwrap("hi", "prompt") == ("hi", "prompt")
    assert unwrap([1, 2], "prompt") == ([1, 2], "prompt")
    assert unwrap({"prompt": "hi"}, "prompts[0]") == ("hi", "prompts[0].prompt")
    assert unwrap({"prompt_token_ids": [3]}, "p") == ([3], "p.prompt_token_ids")
    assert is_ids([1, 2]) and not is_ids("ab") and not is_ids([])


@pytest.mark.parametrize(("bad", "named"), [(3.5, "prompt: must be"), ({"text": "x"}, "prompt: a dict prompt"),
                                            ({"prompt": 1}, "prompt.prompt: must be a string")])  # fmt: skip
def test_a_bad_prompt_is_named(bad: object, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        unwrap(bad, "prompt")


def test_per_prompt_repeats_one_or_checks_the_count() -> None:
    assert per_prompt(5, 3, "priority") == [5, 5, 5]
    with pytest.raises(ValueError, match="priority: 2 given for 3 prompts"):
        per_prompt([1, 2], 3, "priority")
