"""Structured output: seeded samples of SmolLM2 under JSON schemas (nested objects, arrays, enums, numbers), regexes
and a choice all parse and validate; a grammar survives preemption (recompute and swap), interrupts and async
scheduling (each request's seeded output is what it is alone); invalid grammars are refused naming the field."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from proto.wire import SamplingOptions, StepPlan, StructuredOutput
from scheduler_node.api.validation import InvalidField, SamplingFields, StructuredFields, build_spec
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.engine import EngineRun, InterruptingWorkers, Submitted, load_runner

pytestmark = pytest.mark.model

SAMPLES = 50

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    "number": {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}, "in_stock": {"type": "boolean"}},
        "required": ["price", "in_stock"],
        "additionalProperties": False,
    },
}
REGEXES = [r"\(\d{3}\) \d{3}-\d{4}", r"[a-z]{3,10}@[a-z]{3,8}\.(com|org)"]
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path):  # type: ignore[no-untyped-def]
    with LLM(str(smollm2_dir), num_kv_blocks=1024, max_num_seqs=64) as engine:
        yield engine


# name -> (prompt, constraint, max_tokens)
CASES: dict[str, tuple[str, StructuredOutputsParams, int]] = {
    **{
        name: (f"A JSON object ({name}):", StructuredOutputsParams(json=schema), 64) for name, schema in SCHEMAS.items()
    },
    **{regex: ("A contact detail:", StructuredOutputsParams(regex=regex), 24) for regex in REGEXES},
    "choice": ("The movie was great. Sentiment:", StructuredOutputsParams(choice=CHOICES), 8),
}


@pytest.fixture(scope="module")
def samples(llm: LLM) -> dict[str, list[str]]:
    """SAMPLES seeded samples of every case, generated in one batch (the engine keeps 64 running)."""
    prompts, params = [], []
    for prompt, structured, max_tokens in CASES.values():
        prompts += [prompt] * SAMPLES
        params += [
            SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=structured)
            for seed in range(SAMPLES)
        ]
    completions = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    cut = [c.text for c in completions if c.finish_reason != "stop"]
    assert not cut, f"{len(cut)} samples ran out of tokens, e.g. {cut[0]!r}"
    texts = [c.text for c in completions]
    return {name: texts[i * SAMPLES : (i + 1) * SAMPLES] for i, name in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_samples_validate(samples: dict[str, list[str]], name: str) -> None:
    for text in samples[name]:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len(set(samples[name])) > 1, "seeded samples must differ"


@pytest.mark.slow
def test_regex_and_choice_samples_match(samples: dict[str, list[str]]) -> None:
    for regex in REGEXES:
        for text in samples[regex]:
            assert re.fullmatch(regex, text), (regex, text)
        assert len(set(samples[regex])) > 1
    assert set(samples["choice"]) <= set(CHOICES) and len(set(samples["choice"])) > 1


def test_offline_invalid_grammars_raise_value_error_naming_the_field(llm: LLM) -> None:
    for structured, field in [
        (StructuredOutputsParams(json={"type": "objectx"}), "structured.json"),
        (StructuredOutputsParams(json="{not json"), "structured.json"),
        (StructuredOutputsParams(regex="(ab"), "structured.regex"),
        (StructuredOutputsParams(choice=[]), "structured.choice"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "structured"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
            llm.generate("hi", SamplingParams(structured_outputs=structured), use_tqdm=False)


def test_door_neutral_check_names_the_field(smollm2_dir: Path) -> None:
    tokenizer = ModelTokenizer(smollm2_dir)

    def spec(**structured: object) -> None:
        fields = SamplingFields(structured=StructuredFields(**structured))  # type: ignore[arg-type]
        build_spec([1, 2, 3], fields, 100, tokenizer=tokenizer, prefix="sampling.")

    with pytest.raises(InvalidField) as err:
        spec(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    assert err.value.field == "sampling.structured.json"
    with pytest.raises(InvalidField) as err:
        spec(json="[1, 2]")
    assert err.value.field == "sampling.structured.json"
    with pytest.raises(InvalidField) as err:
        spec()
    assert err.value.field == "sampling.structured"


# ---- rollback: a tiny random model, grammars that force its hand

BLOCK = 16
PATTERN = r"[a-z]{4,9}(-[0-9]{2,3}){2,4}"
GRAMMARS = [
    StructuredOutput("regex", PATTERN),
    StructuredOutput("json", json.dumps(SCHEMAS["enum"])),
    StructuredOutput("choice", json.dumps(CHOICES)),
]


def constrained(seed: int) -> list[tuple[list[int], SamplingOptions]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, 49152) for _ in range(rng.randint(5, 40))],
            SamplingOptions(temperature=1.0, seed=100 + i, structured=GRAMMARS[i % len(GRAMMARS)]),
        )
        for i in range(6)
    ]


def add_all(run: EngineRun, requests: list[tuple[list[int], SamplingOptions]]) -> list[Submitted]:
    return [run.add(ids, 40, sampling=options, ignore_eos=False) for ids, options in requests]


def assert_valid(subs: list[Submitted], requests: list[tuple[list[int], SamplingOptions]]) -> None:
    for sub, (_, options) in zip(subs, requests):
        text = sub.completions[0].text
        assert sub.completions[0].finish_reason == "stop", text
        assert options.structured is not None
        if options.structured.kind == "regex":
            assert re.fullmatch(PATTERN, text), text
        elif options.structured.kind == "json":
            jsonschema.validate(json.loads(text), SCHEMAS["enum"])
        else:
            assert text in CHOICES


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    """Each constrained request run alone, with room to spare."""
    outputs = []
    with EngineRun(load_runner(tiny_llama_dir, 64, BLOCK), tokenizer_dir=tiny_llama_dir) as run:
        for request in constrained(1):
            (sub,) = add_all(run, [request])
            run.run()
            assert_valid([sub], [request])
            outputs.append(sub.output)
    return outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammars_survive_preemption(tiny_llama_dir: Path, reference: list[list[int]], mode: str) -> None:
    runner = load_runner(tiny_llama_dir, 9, BLOCK, num_host_blocks=32)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=32, preemption_mode=mode) as run:
        subs = add_all(run, constrained(1))
        run.run()
        counters = run.scheduler.counters
        assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    assert_valid(subs, constrained(1))
    assert [s.output for s in subs] == reference


def test_grammars_survive_interrupts(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    rng = random.Random(4)
    workers = InterruptingWorkers(rng)
    runner = load_runner(tiny_llama_dir, 64, BLOCK)
    run = EngineRun(runner, tokenizer_dir=tiny_llama_dir, transport=workers, max_num_batched_tokens=32)

    def sent(plan: StepPlan) -> None:
        run.plans.append(plan)
        if rng.random() < 0.3:
            asyncio.get_running_loop().call_soon(run.engine.interrupt_in_flight)

    workers.on_plan = sent
    with run:
        subs = add_all(run, constrained(1))
        run.run()
        assert run.scheduler.counters.interrupted_steps > 0
    assert_valid(subs, constrained(1))
    assert [s.output for s in subs] == reference


def test_a_finished_grammar_allows_exactly_the_requests_end_tokens(smollm2_dir: Path) -> None:
    """Where the grammar may end, the request's own end tokens are allowed in place of the tokenizer's EOS: a
    request with stop_token_ids ends on them, one that ignores eos and has none keeps EOS."""
    from worker_node.structured import GrammarMasks, GrammarRow

    tokenizer = ModelTokenizer(smollm2_dir)
    masks = GrammarMasks(tokenizer.path, tokenizer.vocab_size)
    done = tokenizer.encode("yes", add_special_tokens=False)
    choice = StructuredOutput("choice", '["yes"]')
    rows = [GrammarRow(1, choice, done, frozenset({2, 77})), GrammarRow(2, choice, done, frozenset())]
    masks.start(rows)
    allowed = masks.allowed(torch.device("cpu"))
    eos = masks._llg_tokenizer().eos_token
    assert sorted(allowed[0].nonzero().flatten().tolist()) == [2, 77]
    assert allowed[1].nonzero().flatten().tolist() == [eos]
