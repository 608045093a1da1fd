"""The sampling options are declared once (api/sampling.py): every door gathers its request into the same
SamplingFields, so each door knows every option, leaves the same defaults, and refuses the same bad values naming
the same field (as the door calls it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from proto import serving_pb2 as pb
from scheduler_node.api.openai_inputs import completion_specs
from scheduler_node.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from scheduler_node.api.sampling import SamplingFields, StructuredFields
from scheduler_node.api.validation import InvalidField, build_spec, validate
from scheduler_node.core.request import RequestSpec
from scheduler_node.text.tokenizer import ModelTokenizer

pytestmark = pytest.mark.unit

NAMES = [f.name for f in dataclasses.fields(SamplingFields)]
PROMPT = [1, 2, 3]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(smollm2_dir)


def by_grpc(tokenizer: ModelTokenizer, options: dict[str, Any]) -> RequestSpec:
    sampling = pb.SamplingParams(**{k: v for k, v in options.items() if k != "structured"})
    if "structured" in options:
        sampling.regex = options["structured"]
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling)
    return validate(request, tokenizer, MAX_MODEL_LEN)


def by_openai(tokenizer: ModelTokenizer, options: dict[str, Any]) -> RequestSpec:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": None}
    body.update({k: v for k, v in options.items() if k != "structured"})
    if "structured" in options:
        body["structured_outputs"] = {"regex": options["structured"]}
    return completion_specs(CompletionRequest.model_validate(body), tokenizer, MAX_MODEL_LEN, "r", 50)[0]


def by_llm(tokenizer: ModelTokenizer, options: dict[str, Any]) -> RequestSpec:
    params = {k: v for k, v in options.items() if k != "structured"}
    if "structured" in options:
        params["structured_outputs"] = StructuredOutputsParams(regex=options["structured"])
    sp = SamplingParams(**{"max_tokens": None, **params})
    return build_spec(PROMPT, sp.fields(), MAX_MODEL_LEN, tokenizer=tokenizer, request_id="r", priority=50)


# Each door names a field as its own schema does.
DOORS = [
    (by_grpc, lambda name: "sampling." + name.replace("structured", "structured.regex")),
    (by_openai, lambda name: name.replace("structured", "structured_outputs")),
    (by_llm, lambda name: name.replace("structured", "structured.regex")),
]


def test_every_door_has_every_option() -> None:
    grpc_fields = set(pb.SamplingParams.DESCRIPTOR.fields_by_name) | set(pb.SamplingParams.DESCRIPTOR.oneofs_by_name)
    openai_fields = set(ChatCompletionRequest.model_fields) & set(CompletionRequest.model_fields)
    llm_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(NAMES) <= grpc_fields
    assert set(NAMES) - {"structured"} <= openai_fields | {"logprobs"}  # chat names it top_logprobs
    assert {"structured_outputs", "response_format"} <= openai_fields
    assert set(NAMES) - {"structured"} <= llm_fields and "structured_outputs" in llm_fields
    assert {f.name for f in dataclasses.fields(StructuredFields)} <= {
        f.name for f in dataclasses.fields(StructuredOutputsParams)
    }


def test_every_door_leaves_the_same_defaults(tokenizer: ModelTokenizer) -> None:
    specs = [door(tokenizer, {}) for door, _ in DOORS]
    assert all(dataclasses.replace(s, request_id="r") == specs[-1] for s in specs), specs
    assert specs[0].max_tokens == MAX_MODEL_LEN - len(PROMPT) and specs[0].n == 1


def test_every_door_passes_the_same_values(tokenizer: ModelTokenizer) -> None:
    options = {"temperature": 0.5, "top_k": 3, "n": 2, "seed": 7, "stop": ["x"], "min_tokens": 2, "logprobs": 1,
               "stop_token_ids": [9, 4], "logit_bias": {5: -1.0}, "bad_words": ["hi"], "structured": "a+"}  # fmt: skip
    specs = [dataclasses.replace(door(tokenizer, options), request_id="r") for door, _ in DOORS]
    assert specs[0] == specs[1] == specs[2]
    assert specs[0].sampling.structured is not None and specs[0].stop_token_ids == [4, 9]


# One bad value of each option a door cannot refuse by type alone.
BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", MAX_MODEL_LEN),
    ("temperature", -1.0),
    ("top_p", 0.0),
    ("top_k", -2),
    ("n", 0),
    ("logprobs", 21),
    ("stop", ["s"] * 17),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("frequency_penalty", 2.5),
    ("presence_penalty", -3.0),
    ("min_tokens", -1),
    ("stop_token_ids", [10**8]),
    ("logit_bias", {10**8: 1.0}),
    ("bad_words", [" "]),
    ("prompt_logprobs", 21),
    ("structured", ""),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_every_door_refuses_the_same_bad_value(tokenizer: ModelTokenizer, name: str, value: object) -> None:
    for door, named in DOORS:
        with pytest.raises(InvalidField) as err:
            door(tokenizer, {name: value})
        assert err.value.field == named(name), door.__name__


def test_each_option_has_a_bad_value() -> None:
    """A new option gets a bad value above, or says here why it has none."""
    assert set(NAMES) - {name for name, _ in BAD_VALUES} == {"seed", "ignore_eos", "speculate"}  # all flags valid
