"""Per-request KV precision: at equal KV memory, requests held at once and throughput with the memory-sensitive
mode (--kv-compact-under-pressure) on vs off, and what splitting a batch by KV format costs, in one run, on CPU.

(a) capacity: one engine per row, each with the same --kv-cache-memory; `off` keeps every block at full precision,
    `on` gives --kv-compact-fraction of the bytes to compact (int8) blocks that `auto` requests get once the full
    pool is tight. The same burst of requests (all submitted at once, greedy, a fixed number of tokens each) runs
    in each: the most requests running at once (counted after every scheduler step), preemptions, and output
    tokens per second over the burst.
(b) the split: one engine with both pools, each big enough that the whole burst runs at once (--split-memory-factor
    times the budget), the same burst with every request `full`, every one `compact`, and half and half. A mixed
    step runs attention once per pool (worker_node/models/attention.py), so half and half against the mean of the other
    two is the cost of splitting.

    .venv/bin/python scripts/bench_kv_precision.py [--model default] [--json out.json]
    .venv/bin/python scripts/bench_kv_precision.py --smoke    # what CI runs: a tiny model, a small burst
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.tiny_models import build_tiny_model  # noqa: E402
from scheduler_node.core.scheduler import Scheduler  # noqa: E402
from settings.worker import parse_size  # noqa: E402


def _burst(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(prompt_len)] for _ in range(n)]


def _watch_running(scheduler: Scheduler) -> list[int]:
    """The number of running requests after every step (the scheduler's `schedule`, wrapped for this benchmark)."""
    seen: list[int] = []
    schedule = scheduler.schedule

    def counted() -> Any:
        plan = schedule()
        seen.append(len(scheduler.running))
        return plan

    scheduler.schedule = counted  # type: ignore[method-assign]
    return seen


def run(
    args: argparse.Namespace, label: str, engine: dict[str, Any], precisions: list[str], memory_factor: int = 1
) -> dict[str, Any]:
    prompts = _burst(len(precisions), args.prompt_len)
    params = [
        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, kv_precision=p) for p in precisions
    ]
    with LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory * memory_factor,
        max_num_seqs=len(precisions),
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode="recompute",
        enable_prefix_caching=False,  # random prompts share nothing; no cache means no hit can blur the rows
        threads=args.threads,
        **engine,
    ) as llm:
        scheduler = llm.engine.scheduler
        blocks = scheduler.blocks
        running = _watch_running(scheduler)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {
            "row": label,
            "full_blocks": blocks.num_blocks,
            "compact_blocks": blocks.num_compact_blocks,
            "requests": len(precisions),
            "most_running": max(running, default=0),
            "preemptions": scheduler.num_preemptions,
            "output_tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model directory, hub id, or `default` (SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", help="the model's dtype (float32: the same on every CPU)")
    p.add_argument("--kv-cache-memory", default="48MiB", help="the KV memory of every row (the equal budget)")
    p.add_argument("--kv-compact-fraction", type=float, default=0.5, help="the compact share with the mode on")
    p.add_argument("--kv-compact-dtype", default="int8", choices=["int8", "fp8_e4m3"], help="compact blocks' format")
    p.add_argument("--requests", type=int, default=32, help="requests in the burst")
    p.add_argument("--prompt-len", type=int, default=96, help="prompt tokens of each request")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the engine's token budget per step")
    p.add_argument("--split-memory-factor", type=int, default=8, help="(b)'s KV memory, in budgets of (a)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, a small burst (CI)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        if args.model == "default":
            from worker_node.default_model import ensure_default_model

            folder = Path(tempfile.mkdtemp(prefix="bench-kv-precision-"))
            tiny = build_tiny_model("llama", folder, ensure_default_model())
            args.model = str(tiny)
        args.kv_cache_memory, args.requests, args.prompt_len, args.max_tokens = "256KiB", 12, 40, 8
    args.kv_cache_memory = parse_size(args.kv_cache_memory)
    compact = {"kv_compact_fraction": args.kv_compact_fraction, "kv_compact_dtype": args.kv_compact_dtype}
    n = args.requests
    halves = ["full", "compact"] * (n // 2) + ["full"] * (n % 2)
    rows = [
        run(args, "capacity: mode off", {}, ["auto"] * n),
        run(args, "capacity: mode on", {"kv_compact_under_pressure": True, **compact}, ["auto"] * n),
        run(args, "split: all full", compact, ["full"] * n, args.split_memory_factor),
        run(args, "split: all compact", compact, ["compact"] * n, args.split_memory_factor),
        run(args, "split: half and half", compact, halves, args.split_memory_factor),
    ]
    print(f"KV memory {args.kv_cache_memory / 2**20:.2f} MiB per row; {n} requests of {args.prompt_len} + "
          f"{args.max_tokens} tokens; compact share {args.kv_compact_fraction} ({args.kv_compact_dtype})")  # fmt: skip
    print("| row | full blocks | compact blocks | most running | preemptions | tokens/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['full_blocks']} | {r['compact_blocks']} | {r['most_running']} | "
              f"{r['preemptions']} | {r['tokens_per_s']} |")  # fmt: skip
    off, on = rows[0], rows[1]
    full, compact_only, mixed = rows[2], rows[3], rows[4]
    split = mixed["tokens_per_s"] / ((full["tokens_per_s"] + compact_only["tokens_per_s"]) / 2)
    summary = {
        "held_at_once_on_vs_off": round(on["most_running"] / max(off["most_running"], 1), 2),
        "throughput_on_vs_off": round(on["tokens_per_s"] / off["tokens_per_s"], 2),
        "mixed_vs_mean_of_single_format": round(split, 2),
    }
    print(
        f"mode on vs off: {summary['held_at_once_on_vs_off']}x requests held at once, "
        f"{summary['throughput_on_vs_off']}x tokens/s; half-and-half batch vs the mean of one-format batches: "
        f"{summary['mixed_vs_mean_of_single_format']}x tokens/s"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
