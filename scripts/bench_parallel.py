"""Tokens/s of one model served with tensor and pipeline parallelism: TP=1/2, PP=1/2 (and TP2 x PP2).

    .venv/bin/python scripts/bench_parallel.py                          # SmolLM2-135M on CPU, gloo
    .venv/bin/python scripts/bench_parallel.py --layouts 1x1,2x1 --num-requests 8
    .venv/bin/python scripts/bench_parallel.py --layouts 1x2,1x2/1      # PP 2 with P plans in flight vs one
    .venv/bin/python scripts/bench_parallel.py --device cuda --layouts 1x1,2x1,1x2,2x2   # on GPUs (NCCL)
    .venv/bin/python scripts/bench_parallel.py --smoke --model DIR      # CI: TP1 vs TP2 on a tiny model

SmolLM2-135M itself has 9 attention heads and 3 KV heads, which 2 ranks cannot split, so the default model is
`smollm2-8heads`: SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, tied 49152 vocab) with 8 heads of 72
and 4 KV heads, random weights (built once under /tmp; throughput does not depend on the weights).

Each layout is a fresh world (real scheduler and worker processes) serving the same workload: prompts of
32-256 random tokens, 32-128 greedy output tokens, all submitted at once. On CPU every layout gets the same
cores in total (--threads-per-worker 0: cores / world size per worker), so the figure measures what splitting
costs (all-reduces and stage hand-offs over loopback) rather than any speed-up: on a 2-core machine there is
nothing to gain. A layout `TxP/1` runs with one plan in flight (--no-async-scheduling): pipeline stages take
turns instead of working on P plans at once, which shows what the overlap buys. Prints a table; --json writes
the figures; --plot writes a PNG when matplotlib is installed.

`--smoke` checks the script in seconds (CI): TP1 and TP2 worlds serving 4 requests of 8-24 prompt and 4-8 output
tokens, 64 MiB of KV and one thread per worker (a PP world runs the same code here, and each world costs its
processes' start-up). Its figures mean nothing; that every world served every token does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from workload import stream_workload  # noqa: E402

from clients.bench.report import bar_panels  # noqa: E402
from minivllm.cluster import Cluster  # noqa: E402
from proto.wire import ExecutionMode  # noqa: E402

# (shortest, longest) prompt and output tokens of a request
PROMPT_LENS, OUTPUT_LENS = (32, 256), (32, 128)
SMOKE_PROMPT_LENS, SMOKE_OUTPUT_LENS = (8, 24), (4, 8)


def workload(
    n: int,
    seed: int,
    vocab: int,
    prompt_lens: tuple[int, int] = PROMPT_LENS,
    output_lens: tuple[int, int] = OUTPUT_LENS,
) -> list[tuple[list[int], int]]:
    """`n` (random prompt ids, max_tokens) requests of lengths drawn uniformly from the given ranges."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(n)
    ]


def apply_smoke(args: argparse.Namespace) -> None:
    """TP1 vs TP2 on a few short requests, small KV, one thread per worker."""
    args.layouts, args.num_requests, args.kv_cache_memory, args.threads_per_worker = "1x1,2x1", 4, "64MiB", 1


def smollm2_8heads(tokenizer_dir: Path) -> Path:
    """SmolLM2-135M's shape with 8 heads / 4 KV heads (splittable by 2 and 4), random weights, built once."""
    folder = Path("/tmp/minivllm-bench-smollm2-8heads")
    if (folder / "model.safetensors").is_file():
        return folder
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((tokenizer_dir / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=4, head_dim=72)
    config.pop("_model_name_or_path", None)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def parse_layout(text: str) -> tuple[int, int, bool]:
    """'2x2' -> (2, 2, False); '1x2/1' -> (1, 2, True): one plan in flight."""
    shape, _, plans = text.lower().partition("/")
    if plans not in ("", "1"):
        raise ValueError(f"layout {text!r}: only '/1' (one plan in flight) may follow TxP")
    tp, pp = (int(x) for x in shape.split("x"))
    return tp, pp, plans == "1"


def run_layout(
    model: Path, tp: int, pp: int, one_plan: bool, work: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict:
    world = tp * pp
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // world)
    scheduler_args = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    scheduler_args += ["--no-async-scheduling"] if one_plan else []
    scheduler_args += [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    worker_args = ["--kv-cache-memory", args.kv_cache_memory, "--threads", str(threads), "--device", args.device]
    cluster = Cluster(model, scheduler_args, worker_args, num_workers=world)
    try:
        cluster.wait_serving(300)
        counts, elapsed = stream_workload(cluster.channel, work)
    finally:
        cluster.stop()
    if counts != [o for _, o in work]:
        raise RuntimeError(f"TP {tp} x PP {pp} returned the wrong number of tokens\n{cluster.logs()}")
    tokens = sum(counts)
    return {
        "tp": tp,
        "pp": pp,
        "plans_in_flight": ExecutionMode.for_world(tp, pp, not one_plan).plans_in_flight,
        "threads_per_worker": threads,
        "tokens": tokens,
        "seconds": elapsed,
        "tok_s": tokens / elapsed,
    }


def label(row: dict) -> str:
    return f"TP{row['tp']} x PP{row['pp']}" + (" /1" if row["plans_in_flight"] == 1 else "")


def plot(rows: list[dict], path: Path) -> None:
    bar_panels(path, [label(r) for r in rows], [([r["tok_s"] for r in rows], "output tokens/s")])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="smollm2-8heads",
        help="HF folder, 'default' (SmolLM2-135M-Instruct: TP must divide 9 heads), or 'smollm2-8heads'",
    )
    p.add_argument(
        "--layouts",
        default="1x1,2x1,1x2,1x2/1,2x2,2x2/1",
        help="comma-separated TPxPP; TPxPP/1 keeps one plan in flight (stages take turns)",
    )
    p.add_argument("--num-requests", type=int, default=16, help="requests of the workload, all sent at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and lengths")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the scheduler's --max-num-seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the scheduler's --max-num-batched-tokens")
    p.add_argument("--kv-cache-memory", default="1GiB", help="per worker")
    p.add_argument("--threads-per-worker", type=int, default=0, help="0: cores / world size")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each worker takes the GPU of its rank)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--plot", type=Path, help="also write a bar chart here (PNG, needs matplotlib)")
    p.add_argument("--smoke", action="store_true", help="TP1 vs TP2 on 4 short requests, in seconds (CI)")
    args = p.parse_args()
    if args.smoke:
        apply_smoke(args)

    from scheduler_node.engine.model_path import resolve_model
    from scheduler_node.text.tokenizer import ModelTokenizer

    model = smollm2_8heads(resolve_model("default")) if args.model == "smollm2-8heads" else resolve_model(args.model)
    lens = (SMOKE_PROMPT_LENS, SMOKE_OUTPUT_LENS) if args.smoke else (PROMPT_LENS, OUTPUT_LENS)
    work = workload(args.num_requests, args.seed, ModelTokenizer(model).vocab_size, *lens)
    rows = []
    for layout in args.layouts.split(","):
        tp, pp, one_plan = parse_layout(layout)
        row = run_layout(model, tp, pp, one_plan, work, args)
        print(f"{label(row)}: {row['tokens']} tokens in {row['seconds']:.1f} s = {row['tok_s']:.1f} tok/s", flush=True)
        rows.append(row)
    base = rows[0]["tok_s"]
    print("\n| layout | workers x threads | plans in flight | tok/s | vs first |\n|---|---|---|---|---|")
    for r in rows:
        shape = f"{r['tp'] * r['pp']} x {r['threads_per_worker']}"
        print(f"| {label(r)} | {shape} | {r['plans_in_flight']} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x |")
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, device {args.device}",
        "model": model.name,
        "requests": len(work),
        "layouts": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
