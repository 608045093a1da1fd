"""Offline throughput: the same workload through minivllm (real scheduler + worker processes, gRPC) and through
HF transformers `generate` with static padded batches (best of several batch sizes), in one run.

    .venv/bin/python scripts/bench_throughput.py                      # 64 requests, SmolLM2-135M
    .venv/bin/python scripts/bench_throughput.py --num-requests 16 --hf-batch-sizes 8

Workload: prompts of 32–512 random tokens, outputs of 16–256 tokens, fixed seed, ignore_eos, greedy.
Prints tokens/s for both and the ratio (machines here are noisy: only the ratio in one run means much).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from workload import stream_workload  # noqa: E402

from minivllm.cluster import Cluster  # noqa: E402
from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(n)]


def run_minivllm(model: Path, work: list[tuple[list[int], int]], args: argparse.Namespace) -> dict:
    cluster = Cluster(
        model,
        [
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--async-scheduling" if args.async_scheduling else "--no-async-scheduling",
        ],
        ["--kv-cache-memory", args.kv_cache_memory, "--threads", str(args.threads)],
    )
    try:
        cluster.wait_serving()
        counts, elapsed = stream_workload(cluster.channel, work)
        stats = pb_grpc.ControlStub(cluster.channel).GetStats(pb.GetStatsRequest(), timeout=10)
    finally:
        cluster.stop()
    assert counts == [o for _, o in work], "minivllm returned the wrong number of tokens"
    return {
        "tokens": sum(counts),
        "seconds": elapsed,
        "tok_s": sum(counts) / elapsed,
        "worker_idle_ms": stats.mean_worker_idle_ms,
    }


def run_hf(model: Path, work: list[tuple[list[int], int]], batch: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = 2
    useful = 0
    start = time.perf_counter()
    for lo in range(0, len(work), batch):
        chunk = work[lo : lo + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(o for _, o in chunk)
        with torch.inference_mode():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        useful += sum(o for _, o in chunk)  # tokens past a request's own max_tokens are waste
    elapsed = time.perf_counter() - start
    return {"batch": batch, "tokens": useful, "seconds": elapsed, "tok_s": useful / elapsed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-sizes", default="8,16,32", help="comma-separated; the best counts")
    p.add_argument("--skip-hf", action="store_true", help="only run minivllm")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for both engines")
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=True, help="the engine's async mode"
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    from scheduler_node.engine.model_path import resolve_model
    from scheduler_node.text.tokenizer import ModelTokenizer

    model = resolve_model(args.model)
    work = workload(args.num_requests, args.seed, ModelTokenizer(model).vocab_size)
    ours = run_minivllm(model, work, args)
    print(
        f"minivllm: {ours['tokens']} tokens in {ours['seconds']:.1f} s = {ours['tok_s']:.1f} tok/s, "
        f"worker idle between steps {ours['worker_idle_ms']:.1f} ms",
        flush=True,
    )
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "requests": len(work),
        "minivllm": ours,
    }
    if not args.skip_hf:
        hf = [run_hf(model, work, int(b), args.threads) for b in args.hf_batch_sizes.split(",")]
        for r in hf:
            print(f"HF generate batch {r['batch']}: {r['tok_s']:.1f} tok/s ({r['seconds']:.1f} s)", flush=True)
        best = max(hf, key=lambda r: r["tok_s"])
        report["hf"] = hf
        report["ratio"] = ours["tok_s"] / best["tok_s"]
        print(f"\n| engine | tok/s |\n|---|---|\n| minivllm | {ours['tok_s']:.1f} |")
        print(f"| HF generate (best, batch {best['batch']}) | {best['tok_s']:.1f} |")
        print(f"| ratio | {report['ratio']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
