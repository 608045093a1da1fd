"""The door-neutral checks of the new sampling fields (every door uses build_spec), and the import boundaries the
grammar engine must respect: the scheduler never imports torch, the worker never imports grpc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_node.api.validation import InvalidField, SamplingFields, build_spec
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(smollm2_dir)


def spec(tokenizer: ModelTokenizer, **fields: object):  # type: ignore[no-untyped-def]
    return build_spec([1, 2, 3], SamplingFields(**fields), 64, tokenizer=tokenizer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["w"] * 65}, "bad_words"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_values_name_their_field(tokenizer: ModelTokenizer, fields: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidField) as err:
        spec(tokenizer, **fields)
    assert err.value.field == name


def test_good_values_reach_the_worker_options(tokenizer: ModelTokenizer) -> None:
    s = spec(
        tokenizer,
        max_tokens=10,
        min_tokens=10,
        logit_bias={"17": 2.5, 5: -100},  # OpenAI's JSON keys are strings
        stop_token_ids=[9, 4, 9],
        bad_words=["hello"],
        repetition_penalty=1.1,
    )
    o = s.sampling
    assert o.logit_bias == {17: 2.5, 5: -100.0} and o.min_tokens == 10 and o.repetition_penalty == 1.1
    assert s.stop_token_ids == [4, 9]
    alone, spaced = tokenizer.encode("hello", False), tokenizer.encode(" hello", False)
    assert alone != spaced and o.bad_words == [alone, spaced], "a word is banned at the start and after a space"


def test_scheduler_never_imports_torch_and_worker_never_imports_grpc() -> None:
    for modules, banned in [
        ("scheduler_node.api.validation, scheduler_node.engine.core, proto.structured", "torch"),
        ("worker_node.worker, worker_node.sampler, worker_node.structured", "grpc"),
    ]:
        code = f"import sys, {modules}; print({banned!r} in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False", banned
