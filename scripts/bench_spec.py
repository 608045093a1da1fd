"""Speculative decoding: n-gram proposals against none, in one run, on a copy-heavy and the mixed workload.

    .venv/bin/python scripts/bench_spec.py                   # SmolLM2-135M-Instruct, concurrency 1, 4, 16, 64
    .venv/bin/python scripts/bench_spec.py --concurrency 1 4 --workloads copy
    .venv/bin/python scripts/bench_spec.py --smoke           # seconds; what CI runs
    .venv/bin/python scripts/bench_spec.py --draft-model DIR # and a third engine: that draft model's proposals

Two offline engines (`minivllm.LLM`, in-process workers) live side by side, one with `--speculative-config` and one
without (a third with a draft model when given); each (workload, concurrency) cell runs on each, rotating which goes
first, so that the machine's noise hits them alike. Concurrency C is the engine's max_num_seqs = C with 2 x C
requests (at least 4; C from 16 on) sent at once.

Workloads:
- copy: chat prompts whose answers copy their prompt: repeat or correct a given text, quote the sentences of a
  passage that answer a question, rename an identifier in a piece of code (real SmolLM2 outputs, greedy, up to
  --max-tokens each, eos ends them).
- mixed: bench_throughput.py's workload (prompts of 32-512 random tokens, outputs of 16-256, greedy, ignore_eos).

Per cell: decode tok/s (tokens after each request's first, over the time some request was decoding), mean TPOT
(a request's time from its first to its last token over its tokens after the first), and with speculation the mean
acceptance length (tokens per speculated step: accepted proposals + 1) and how many steps speculated; the process
CPU time per decoded token (every thread's: less sensitive to other jobs on the machine than wall time); the load
average at the end of the cell. A cell whose greedy outputs differ between the engines says so (speculation must
change no token; in bf16 a verify step's other batch shape may flip a near-tie, see
docs/benchmarks/history/speculative-decoding.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minivllm import LLM, SamplingParams  # noqa: E402
from scheduler_node.api.validation import build_spec  # noqa: E402
from scheduler_node.core.request import RequestSpec  # noqa: E402
from scheduler_node.engine.core import EngineCore  # noqa: E402

STEP_TIMEOUT_S = 900.0
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}

TEXTS = [
    "The committee met on Tuesday to discuss the budget for the new library. After a long debate they agreed to "
    "fund the children's reading room, the archive of local newspapers, and a small cafe near the entrance. Work "
    "will begin in the spring and should finish before the first snow of the winter.",
    "Our train left the station at seven in the morning. We crossed the river, passed the old mill and the long "
    "row of poplar trees, and reached the coast just before noon, where my grandmother was waiting for us with a "
    "basket of bread, cheese and apples from her garden.",
    "To reset your password, open the settings page, choose the security tab, and press the button labelled "
    "reset. You will receive an email with a link that stays valid for one hour. Follow the link and enter your "
    "new password twice. If the email does not arrive, check your spam folder.",
    "The museum opens at nine and closes at six, except on Mondays, when it is closed all day. Tickets cost ten "
    "euros for adults and five for students. Children under twelve enter for free. Guided tours in English start "
    "at eleven and at three.",
]
CODE = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price "
    "* item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n        self.count "
    "+= 1\n        return self.count\n\n    def reset(self):\n        self.count = 0\n",
]


def copy_prompts() -> list[list[dict[str, str]]]:
    """Chat conversations whose answers copy from their prompt."""
    asks = []
    for text in TEXTS:
        asks.append(f"Repeat the following text exactly, word for word:\n\n{text}")
        asks.append(f"Correct any mistakes in this text and write it out again in full:\n\n{text}")
        asks.append(f"Here is a passage:\n\n{text}\n\nQuote the passage again, sentence by sentence.")
    for code in CODE:
        asks.append(f"Rewrite this Python code, renaming every variable to a longer descriptive name:\n\n{code}")
        asks.append(f"Add a docstring to this Python code and write out the whole code again:\n\n{code}")
    return [[{"role": "user", "content": a}] for a in asks]


@dataclass(slots=True)
class Timed:
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0
    ids: list[int] = field(default_factory=list)


async def _timed(engine: EngineCore, specs: list[RequestSpec]) -> tuple[list[Timed], float]:
    """Submit every request at once; each one's first and last token times and its tokens; the wall time."""
    start = time.perf_counter()
    streams = [engine.submit(s) for s in specs]
    timings = [Timed() for _ in specs]

    async def read(i: int) -> None:
        t = timings[i]
        async for delta in streams[i]:
            if delta.error is not None:
                raise RuntimeError(f"request failed: {delta.error.message}")
            if delta.token_ids:
                now = time.perf_counter()
                t.first = t.first or now
                t.last = now
                t.tokens += len(delta.token_ids)
                t.ids += delta.token_ids

    await asyncio.gather(*(read(i) for i in range(len(specs))))
    return timings, time.perf_counter() - start


def decode_figures(timings: list[Timed]) -> tuple[float, float]:
    """decode tok/s over the union of the requests' decoding intervals, and the mean TPOT in ms."""
    spans = sorted((t.first, t.last) for t in timings if t.tokens > 1)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    decoded = sum(t.tokens - 1 for t in timings if t.tokens > 1)
    tpots = [(t.last - t.first) / (t.tokens - 1) for t in timings if t.tokens > 1]
    return (decoded / busy if busy else 0.0), (1e3 * sum(tpots) / len(tpots) if tpots else 0.0)


class Engine:
    """One offline engine and what it ran."""

    def __init__(
        self, name: str, model: str | None, speculative: dict[str, Any] | None, args: argparse.Namespace
    ) -> None:
        self.name = name
        self.llm = LLM(
            model,
            speculative_config=speculative,
            max_num_seqs=max(args.concurrency),
            kv_cache_memory=args.kv_cache_memory,
            threads=args.threads,
        )
        # A measurement, not a service: a machine shared with other jobs may stall one big prefill step for over
        # the default minute, which would declare the in-process rank lost and end the run.
        engine = self.llm.engine
        engine.options = dataclasses.replace(engine.options, step_timeout=STEP_TIMEOUT_S)

    def run(self, prompts: list[list[int]], params: list[SamplingParams], concurrency: int) -> dict[str, Any]:
        llm = self.llm
        engine = llm.engine
        engine.scheduler.config = _with_max_num_seqs(engine.scheduler.config, concurrency)
        specs = [
            build_spec(p, sp.fields(), engine.max_model_len, tokenizer=llm.tokenizer, request_id=f"b{i}-{time.time()}")
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        spec = engine.scheduler.speculator
        before = (spec.counters.num_drafts, spec.counters.num_accepted_tokens) if spec else (0, 0)
        cpu = time.process_time()
        timings, wall = llm._call(_timed(engine, specs))  # the LLM's own loop runs the engine
        cpu = time.process_time() - cpu
        tok_s, tpot = decode_figures(timings)
        row: dict[str, Any] = {"decode_tok_s": tok_s, "tpot_ms": tpot, "tokens": sum(t.tokens for t in timings)}
        row["wall_s"] = wall
        row["cpu_ms_per_token"] = 1e3 * cpu / max(1, row["tokens"])
        row["outputs"] = [t.ids for t in timings]
        if spec is not None:
            drafts = spec.counters.num_drafts - before[0]
            accepted = spec.counters.num_accepted_tokens - before[1]
            row["acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
            row["speculated_steps"] = drafts
        return row

    def close(self) -> None:
        self.llm.close()


def _with_max_num_seqs(config: Any, n: int) -> Any:
    return dataclasses.replace(config, max_num_seqs=n)


def workloads(llm: LLM, names: list[str], n: int, max_tokens: int, smoke: bool) -> dict[str, tuple[list, list]]:
    """name -> (prompt ids, sampling params) of n requests."""
    out: dict[str, tuple[list, list]] = {}
    if "copy" in names:
        convs = copy_prompts()
        tok = llm.tokenizer
        ids = [tok.apply_chat_template(convs[i % len(convs)]) for i in range(n)]
        out["copy"] = (ids, [SamplingParams(temperature=0.0, max_tokens=max_tokens) for _ in ids])
    if "mixed" in names:
        rng = random.Random(0)
        prompt_range, output_range = ((8, 32), (4, 16)) if smoke else ((32, 512), (16, 256))
        vocab = llm.tokenizer.vocab_size
        ids, params = [], []
        for _ in range(n):
            ids.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))])
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(*output_range), ignore_eos=True))
        out["mixed"] = (ids, params)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="max_num_seqs values")
    p.add_argument("--workloads", nargs="+", default=["copy", "mixed"], choices=["copy", "mixed"])
    p.add_argument("--max-tokens", type=int, default=160, help="output tokens at most per copy-heavy request")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell and engine (the best one counts)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the worker's default)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV cache of each of the two engines")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny run (CI): concurrency 2, short outputs")
    p.add_argument("--draft-model", default="", help="also run a draft model's proposals (a model folder)")
    args = p.parse_args()
    if args.smoke:
        args.concurrency, args.max_tokens, args.repeats, args.kv_cache_memory = [2], 16, 1, "256MiB"
    engines = [Engine("off", args.model, None, args), Engine("ngram", args.model, NGRAM, args)]
    if args.draft_model:
        draft = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": 4}
        engines.append(Engine("draft", args.model, draft, args))
    rows = []
    try:
        for conc in args.concurrency:
            n = conc + 1 if args.smoke else (max(4, 2 * conc) if conc < 16 else conc)
            for name, (ids, params) in workloads(
                engines[0].llm, args.workloads, n, args.max_tokens, args.smoke
            ).items():
                best: dict[str, dict[str, Any]] = {}
                outputs: dict[str, list[list[int]]] = {}
                for r in range(args.repeats):
                    for e in engines[r % len(engines) :] + engines[: r % len(engines)]:  # each goes first in turn
                        row = e.run(ids, params, conc)
                        outputs[e.name] = row.pop("outputs")
                        if e.name not in best or row["decode_tok_s"] > best[e.name]["decode_tok_s"]:
                            best[e.name] = row
                off = best["off"]
                cell: dict[str, Any] = {"workload": name, "concurrency": conc, **best}
                for e in engines[1:]:
                    on = best[e.name]
                    on["speedup"] = on["decode_tok_s"] / off["decode_tok_s"] if off["decode_tok_s"] else 0.0
                    on["cpu_speedup"] = off["cpu_ms_per_token"] / on["cpu_ms_per_token"]
                    on["identical"] = outputs[e.name] == outputs["off"]  # greedy: speculation must change no token
                cell["speedup"] = best["ngram"]["speedup"]
                cell["identical"] = all(best[e.name]["identical"] for e in engines[1:])
                cell["load"] = os.getloadavg()[0]
                rows.append(cell)
                print_row(cell, [e.name for e in engines[1:]])
    finally:
        for e in engines:
            e.close()
    load = os.getloadavg()
    print(f"# {datetime.date.today()}  threads={args.threads or 'default'}  load average {load[0]:.1f} {load[1]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def print_row(row: dict[str, Any], names: list[str]) -> None:
    off = row["off"]
    line = (
        f"{row['workload']:6} c={row['concurrency']:<3} load {row['load']:4.1f} | off {off['decode_tok_s']:7.1f} tok/s"
    )
    line += f" TPOT {off['tpot_ms']:6.1f} ms cpu {off['cpu_ms_per_token']:6.1f} ms/tok"
    for name in names:
        on = row[name]
        line += (
            f" | {name} {on['decode_tok_s']:7.1f} tok/s TPOT {on['tpot_ms']:6.1f} ms"
            f" accept len {on.get('acceptance_length', 0):.2f} ({on.get('speculated_steps', 0)} steps)"
            f" x{on['speedup']:.2f} (cpu x{on['cpu_speedup']:.2f}){'' if on['identical'] else ' OUTPUTS DIFFER'}"
        )
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
