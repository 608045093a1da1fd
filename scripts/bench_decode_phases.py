"""Where a CPU decode step's time goes: per phase of a decoder layer, per weight format and batch size.

The C decode runner (worker_node/models/native_decode.py, kernels/csrc/decode_layers_cpu.c) times each phase of
each layer under `LLM(decode_phases=True)` (`native_decode.phase_seconds`); this script sets it, decodes N
sequences of 16-token random prompts for --tokens tokens each in an in-process engine per format, and prints the
milliseconds per step of the whole step (wall time, the engine and the prefill of the prompts included) and of each
phase summed over the layers, medians of --rounds runs. The runner takes bf16 Llama-family models on CPUs with the
C matmul kernels (AMX, AVX-512 BF16, AVX2: kernels/cpu_isa.py), so --dtype is bfloat16 unless told otherwise;
where it does not run, the report says so and has no phases.

    .venv/bin/python scripts/bench_decode_phases.py --formats none,int8,awq@FOLDER --seqs 16,64 --threads 2
    .venv/bin/python scripts/bench_decode_phases.py --smoke --model DIR   # what CI runs: a tiny model, a few tokens
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.cpu_decode_layers import PHASES  # noqa: E402
from worker_node.models import native_decode  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--formats", default="none,int8", help="--quantization values; FORMAT@FOLDER runs a checkpoint")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype (the runner takes bfloat16)")
    p.add_argument("--seqs", default="16,64", help="sequences decoded together, comma-separated (at most 64)")
    p.add_argument("--tokens", type=int, default=128, help="tokens each sequence decodes")
    p.add_argument("--rounds", type=int, default=3, help="runs per figure (medians)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    args.seqs = [int(n) for n in args.seqs.split(",")]
    if args.smoke:
        args.seqs, args.tokens, args.rounds = [2], 4, 1
    return args


def measure(model: str, fmt: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per sequence count: ms per step of the whole step and of each phase (None: the runner did not run)."""
    from minivllm import LLM, SamplingParams

    quantization = "auto" if "@" in fmt else fmt
    folder = fmt.partition("@")[2] or model
    rows = []
    with LLM(
        folder,
        dtype=args.dtype,
        quantization=quantization,
        max_num_seqs=max(args.seqs),
        threads=args.threads,
        decode_phases=True,
    ) as llm:
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        llm.generate([[5, 6, 7]], [SamplingParams(max_tokens=2, temperature=0.0)], use_tqdm=False)  # warm-up
        vocab = llm.tokenizer.vocab_size
        rng = random.Random(0)
        for n in args.seqs:
            prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n)]
            steps, phases = [], []
            for _ in range(args.rounds):
                before, start = native_decode.phase_seconds(), time.perf_counter()
                llm.generate(prompts, [params] * n, use_tqdm=False)
                steps.append((time.perf_counter() - start) / args.tokens * 1e3)
                phases.append((native_decode.phase_seconds() - before) / args.tokens * 1e3)
            ran = any(float(p.sum()) > 0 for p in phases)
            per_phase = {name: statistics.median(float(p[i]) for p in phases) for i, name in enumerate(PHASES)}
            step = statistics.median(steps)
            rows.append({"format": fmt, "seqs": n, "step_ms": step, "phases_ms": per_phase if ran else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from scheduler_node.engine.model_path import resolve_model

    model = str(resolve_model(args.model))
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "tokens": args.tokens,
        "rows": [row for fmt in args.formats.split(",") for row in measure(model, fmt, args)],
    }
    report["load_average_after"] = os.getloadavg()
    print(f"{report['date']}, {args.threads} threads, {args.tokens} tokens, load {report['load_average']}")
    print("| format | seqs | step ms | layers ms | " + " | ".join(PHASES) + " |\n|" + "---|" * (4 + len(PHASES)))
    for row in report["rows"]:
        phases = row["phases_ms"]
        cells = [f"{phases[name]:.2f}" for name in PHASES] if phases else ["-"] * len(PHASES)
        layers = f"{sum(phases.values()):.2f}" if phases else "the C runner did not run"
        print(f"| {row['format']} | {row['seqs']} | {row['step_ms']:.2f} | {layers} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
