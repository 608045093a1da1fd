"""Grammar engines for structured output: llguidance (what minivllm uses) against xgrammar, in one run.

The cost that matters is the per-token mask: each decode step, every constrained request of the batch needs the
set of tokens its grammar allows next. Here 64 matchers (JSON schemas, a regex, a choice) walk real token
sequences of valid outputs in lock-step; each step fills the batch's bitmask with the engine's parallel batch
call, then every matcher accepts its next token (a finished one starts over). Reported: compile time per grammar,
mask time per step at batch 64, and per token (per request and step), with llguidance / xgrammar ratios.

    .venv/bin/python scripts/bench_grammar.py                 # SmolLM2-135M's tokenizer, batch 64, 200 steps
    .venv/bin/python scripts/bench_grammar.py --smoke         # CI: batch 8, 10 steps
    .venv/bin/python scripts/bench_grammar.py --engine        # also: the engine's tok/s with and without a schema

`--engine` runs the offline LLM (in-process worker) on 64 seeded requests at once, unconstrained and then under
a JSON schema, 24 tokens each (ignore_eos: a finished grammar allows only EOS, so the batch stays full and every
step computes 64 masks): with the masks off the critical path the two decode at about the same rate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

if TYPE_CHECKING:  # imported where used: each engine is optional until it is measured
    import llguidance
    import xgrammar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proto.structured import grammar_of  # noqa: E402
from proto.wire import StructuredOutput  # noqa: E402
from scheduler_node.engine.model_path import DEFAULT, resolve_model  # noqa: E402

# (kind, spec, a valid output): the outputs are the token sequences the matchers walk.
WORKLOAD: list[tuple[str, str, str]] = [
    (
        "json",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "age", "tags", "address"],
            }
        ),
        '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "10115"}}',
    ),
    (
        "json",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"id": {"type": "integer"}, "price": {"type": "number"}},
                            "required": ["id", "price"],
                        },
                    },
                    "status": {"enum": ["open", "closed", "pending"]},
                },
                "required": ["items", "status"],
            }
        ),
        '{"items": [{"id": 1, "price": 9.5}, {"id": 22, "price": 0.25}, {"id": 3, "price": 100}], "status": "open"}',
    ),
    ("regex", r"\d{3}-\d{3}-\d{4}", "555-867-5309"),
    ("regex", r"(yes|no), because [a-z ]{1,40}\.", "yes, because the sky is blue."),
    ("choice", json.dumps(["positive", "negative", "neutral"]), "neutral"),
]


Grammar = TypeVar("Grammar")
Matcher = TypeVar("Matcher")


@dataclass
class Engine(Generic[Grammar, Matcher]):
    name: str
    compile: Callable[[str, str], Grammar]  # (kind, spec) -> compiled grammar
    matcher: Callable[[Grammar], Matcher]
    fill: Callable[[list[Matcher], np.ndarray], None]  # masks of these matchers into rows 0..n-1
    accept: Callable[[Matcher, int], bool]
    reset: Callable[[Matcher], object]


def llguidance_engine(folder: Path, vocab: int) -> Engine[str, llguidance.LLMatcher]:
    import llguidance
    import llguidance.numpy

    tokenizer = llguidance.LLTokenizer(str(folder / "tokenizer.json"), n_vocab=vocab, eos_token=EOS)
    executor = llguidance.LLExecutor()

    def compile_(kind: str, spec: str) -> str:
        grammar = grammar_of(StructuredOutput(kind, spec))  # the grammar the worker enforces
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def fill(matchers: list[llguidance.LLMatcher], bitmask: np.ndarray) -> None:
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    return Engine(
        "llguidance",
        compile_,
        lambda grammar: llguidance.LLMatcher(tokenizer, grammar),
        fill,
        lambda m, t: m.consume_token(t),
        lambda m: m.reset(),
    )


def xgrammar_engine(folder: Path, vocab: int) -> Engine[xgrammar.CompiledGrammar, xgrammar.GrammarMatcher]:
    import torch
    import xgrammar
    from transformers import AutoTokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(folder), vocab_size=vocab, stop_token_ids=EOS
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    batch = xgrammar.BatchGrammarMatcher()

    def compile_(kind: str, spec: str) -> xgrammar.CompiledGrammar:
        if kind == "json":
            return compiler.compile_json_schema(spec)
        if kind == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_regex("|".join(_escape(c) for c in json.loads(spec)))

    def fill(matchers: list[xgrammar.GrammarMatcher], bitmask: np.ndarray) -> None:
        batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    return Engine(
        "xgrammar",
        compile_,
        lambda grammar: xgrammar.GrammarMatcher(grammar),
        fill,
        lambda m, t: m.accept_token(t),
        lambda m: m.reset(),
    )


def _escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)


def measure(engine: Engine[Any, Any], paths: list[list[int]], batch: int, steps: int) -> dict:
    compile_s = []
    grammars = []
    for kind, spec, _ in WORKLOAD:
        start = time.perf_counter()
        grammars.append(engine.compile(kind, spec))
        compile_s.append(time.perf_counter() - start)
    matchers = [engine.matcher(grammars[i % len(grammars)]) for i in range(batch)]
    walk = [paths[i % len(paths)] for i in range(batch)]
    position = [0] * batch
    vocab_words = -(-VOCAB // 32)
    bitmask = np.full((batch, vocab_words), -1, dtype=np.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.fill(matchers, bitmask)
        times.append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            token = walk[i][position[i]]
            if not bitmask[i, token // 32] >> (token % 32) & 1:
                raise AssertionError(f"{engine.name}: the mask forbids token {token} of a valid output")
            if not engine.accept(m, token):
                raise AssertionError(f"{engine.name}: token {token} refused")
            position[i] += 1
            if position[i] == len(walk[i]):
                engine.reset(m)
                position[i] = 0
    step_ms = statistics.median(times) * 1e3
    return {
        "engine": engine.name,
        "compile_ms": 1e3 * statistics.mean(compile_s),
        "step_ms": step_ms,
        "p99_step_ms": sorted(times)[min(len(times) - 1, int(0.99 * len(times)))] * 1e3,
        "token_us": step_ms * 1e3 / batch,
    }


VOCAB = 0
EOS: list[int] = []


def main() -> None:
    global VOCAB, EOS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT, help="model folder or hub id (its tokenizer is used)")
    parser.add_argument("--batch", type=int, default=64, help="matchers masked together each step")
    parser.add_argument("--steps", type=int, default=200, help="steps measured")
    parser.add_argument("--smoke", action="store_true", help="a quick run for CI (batch 8, 10 steps)")
    parser.add_argument("--engine", action="store_true", help="also measure the engine's tok/s with a schema")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps = 8, 10
    folder = resolve_model(args.model)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    VOCAB = json.loads((folder / "config.json").read_text())["vocab_size"]
    EOS = [_eos(folder)]
    paths = [tokenizer.encode(text, add_special_tokens=False).ids + EOS for _, _, text in WORKLOAD]
    rows = [
        measure(make(folder, VOCAB), paths, args.batch, args.steps) for make in (llguidance_engine, xgrammar_engine)
    ]
    stamp = f"{datetime.date.today()} on {platform.machine()} {platform.processor() or ''}".strip()
    print(f"grammar mask cost, batch {args.batch}, {args.steps} steps, vocab {VOCAB} ({stamp})")
    print(f"{'engine':<12}{'compile ms':>12}{'step ms (p50)':>16}{'step ms (p99)':>16}{'us / token':>12}")
    for r in rows:
        print(
            f"{r['engine']:<12}{r['compile_ms']:>12.2f}{r['step_ms']:>16.3f}{r['p99_step_ms']:>16.3f}"
            f"{r['token_us']:>12.1f}"
        )
    ratio = rows[0]["step_ms"] / rows[1]["step_ms"]
    print(
        f"llguidance / xgrammar mask time: {ratio:.2f}x; compile: {rows[0]['compile_ms'] / rows[1]['compile_ms']:.2f}x"
    )
    rates = engine_rates(folder, args.batch) if args.engine else {}
    for label, rate in rates.items():
        print(f"engine, {args.batch} requests at once, {label}: {rate:.1f} output tok/s")
    if args.json:
        results = {"batch": args.batch, "steps": args.steps, "rows": rows, "engine_tok_s": rates}
        args.json.write_text(json.dumps(results, indent=2))


ENGINE_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0}},
    "required": ["name", "count"],
    "additionalProperties": False,
}


def engine_rates(folder: Path, batch: int) -> dict[str, float]:
    """Output tok/s of the offline engine on `batch` seeded requests at once, plain and under a JSON schema."""
    from minivllm import LLM, SamplingParams, StructuredOutputsParams

    rates = {}
    with LLM(str(folder), num_kv_blocks=1024, max_num_seqs=batch) as llm:
        for label, structured in (("plain", None), ("json schema", StructuredOutputsParams(json=ENGINE_SCHEMA))):
            params = [
                SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True, structured_outputs=structured)
                for i in range(batch)
            ]
            llm.generate(["Warm up:"] * batch, params, use_tqdm=False)
            start = time.perf_counter()
            outputs = llm.generate(["A JSON object:"] * batch, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[label] = tokens / (time.perf_counter() - start)
    return rates


def _eos(folder: Path) -> int:
    eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    return eos[0] if isinstance(eos, list) else int(eos)


if __name__ == "__main__":
    main()
