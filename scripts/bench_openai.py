"""What the OpenAI HTTP door costs: vllm-bench's workload through the gRPC door and through the HTTP API of one
server (real scheduler + worker processes), alternating, in one run; prints each round and the ratio.

    .venv/bin/python scripts/bench_openai.py                 # SmolLM2-135M, 32 requests at once, 3 rounds each
    .venv/bin/python scripts/bench_openai.py --smoke         # 8 short requests, 1 round each (CI)
    .venv/bin/python scripts/bench_openai.py --request-rate 4 --num-prompts 64

Workload: random prompts of --input-len tokens and outputs of --output-len tokens (ignore_eos, greedy), the same
prompts in every round (the server runs with --no-enable-prefix-caching so no round profits from another's
cache). Output tokens/s is the figure compared; machines here are noisy, so compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clients.bench import main as bench  # noqa: E402
from clients.bench.results import RunSummary  # noqa: E402
from minivllm.cluster import Cluster  # noqa: E402
from scheduler_node.engine.model_path import DEFAULT, resolve_model  # noqa: E402


def run_once(cluster: Cluster, backend: str, model: Path, args: argparse.Namespace) -> RunSummary:
    target = (
        ["--backend", "grpc", "--grpc-address", cluster.address]
        if backend == "grpc"
        else ["--base-url", cluster.base_url]
    )
    argv = [*target, "--tokenizer", str(model), "--num-prompts", str(args.num_prompts), "--input-len",
            str(args.input_len), "--output-len", str(args.output_len), "--request-rate", args.request_rate,
            "--no-progress"]  # fmt: skip
    bench_args = bench.build_parser().parse_args(argv)
    summaries, _ = asyncio.run(bench.sweep(bench_args, bench.prompt_maker(bench_args), [float(args.request_rate)]))
    summary = summaries[0]
    if summary.failed:
        raise RuntimeError(f"{backend}: {summary.failed} request(s) failed: {summary.errors}\n{cluster.logs()}")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once)")
    p.add_argument("--rounds", type=int, default=3, help="runs per door, alternating which goes first")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    p.add_argument("--smoke", action="store_true", help="8 requests of 16 + 8 tokens, one round (CI)")
    args = p.parse_args()
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.rounds = 8, 16, 8, 1
    model = resolve_model(args.model)
    cluster = Cluster(
        model,
        ["--no-enable-prefix-caching", "--max-num-seqs", str(max(args.num_prompts, 8))],
        ["--kv-cache-memory", "512MiB", "--threads", str(args.threads)],
        http=True,
    )
    runs: dict[str, list[RunSummary]] = {"grpc": [], "openai": []}
    try:
        cluster.wait_serving()
        for i in range(args.rounds):
            for backend in ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc"):
                runs[backend].append(run_once(cluster, backend, model, args))
    finally:
        cluster.stop()
    tokens = {b: {r.total_output_tokens for r in rs} for b, rs in runs.items()}
    assert tokens["grpc"] == tokens["openai"] and len(tokens["grpc"]) == 1, f"the doors' outputs differ: {tokens}"

    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {model.name}, {args.num_prompts} "
          f"requests of {args.input_len} + {args.output_len} tokens at rate {args.request_rate}")  # fmt: skip
    print("| door | output tok/s per round | median | TTFT p50 (ms) | ITL p50 (ms) |")
    print("|---|---|---|---|---|")
    median = {}
    for backend, name in (("grpc", "gRPC"), ("openai", "OpenAI HTTP")):
        rs = runs[backend]
        median[backend] = statistics.median(r.output_throughput for r in rs)
        rounds = " / ".join(f"{r.output_throughput:.1f}" for r in rs)
        ttft = statistics.median(r.latency_ms["ttft"]["p50"] for r in rs)
        itl = statistics.median(r.latency_ms["itl"]["p50"] for r in rs)
        print(f"| {name} | {rounds} | {median[backend]:.1f} | {ttft:.1f} | {itl:.1f} |")
    print(f"| HTTP / gRPC | | **{median['openai'] / median['grpc']:.3f}** | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
