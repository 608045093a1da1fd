"""QoS benchmark: a batch load at saturation plus a trickle of realtime requests, under fcfs, priority and hybrid,
in one run, on a real scheduler + worker (SmolLM2-135M by default).

Reports the realtime class's P50/P99 time to first token and end-to-end latency (and their unloaded values),
and the batch class's worst wait for its first token. Our bar: realtime P99 TTFT under `priority` within 1.5x of
its unloaded value, and no batch request starves or fails. `--back-to-back` sends each realtime request the moment
the previous one finished (the hardest pattern: the next one arrives while the batch request the last one
displaced resumes).

    .venv/bin/python scripts/bench_priority.py [--back-to-back] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minivllm.cluster import Cluster  # noqa: E402
from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402


def timed(stub: pb_grpc.GenerationStub, ids: list[int], max_tokens: int, priority: int) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds of one streamed request."""
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids),
        priority=priority,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    start = time.perf_counter()
    ttft = 0.0
    for delta in stub.Generate(request, timeout=1800):
        if delta.token_ids and not ttft:
            ttft = time.perf_counter() - start
    return ttft, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(model: Path, policy: str, args: argparse.Namespace, with_batch: bool) -> dict:
    rng = random.Random(0)
    cluster = Cluster(
        model,
        [
            *("--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs), "--aging-interval", "2"),
            *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
        ],
        ["--kv-cache-memory", "2GiB"],
    )
    try:
        cluster.wait_serving()
        stub = pb_grpc.GenerationStub(cluster.channel)
        batch_waits: list[float] = []
        batch_failed: list[str] = []
        realtime: list[tuple[float, float]] = []
        stop = threading.Event()

        def batch_client() -> None:  # a closed loop: each client sends its next batch request at once
            while not stop.is_set():
                ids = [rng.randrange(3, 49152) for _ in range(args.batch_prompt)]
                try:
                    batch_waits.append(timed(stub, ids, args.batch_tokens, args.batch_priority)[0])
                except grpc.RpcError as exc:
                    batch_failed.append(str(exc.code()))

        clients = [threading.Thread(target=batch_client) for _ in range(args.batch_clients if with_batch else 0)]
        for c in clients:
            c.start()
        time.sleep(3.0 if with_batch else 0.0)  # reach saturation first
        for _ in range(args.realtime):
            ids = [rng.randrange(3, 49152) for _ in range(args.realtime_prompt)]
            realtime.append(timed(stub, ids, args.realtime_tokens, args.realtime_priority))
            time.sleep(0.0 if args.back_to_back else args.realtime_gap)
        stop.set()
        for c in clients:
            c.join()
    finally:
        cluster.stop()
    ttfts = [t for t, _ in realtime]
    e2e = [e for _, e in realtime]
    return {
        "policy": policy,
        "loaded": with_batch,
        "rt_ttft_p50": statistics.median(ttfts),
        "rt_ttft_p99": percentile(ttfts, 0.99),
        "rt_e2e_p50": statistics.median(e2e),
        "rt_e2e_p99": percentile(e2e, 0.99),
        "batch_worst_ttft": max(batch_waits, default=0.0),
        "batch_done": len(batch_waits),
        "batch_failed": len(batch_failed),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model directory, hub id, or `default` (SmolLM2-135M)")
    p.add_argument("--policies", default="fcfs,priority,hybrid", help="scheduling policies under load, comma-separated")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the server's --max-num-seqs")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="the step's token budget: it bounds how long a step runs, so how long a new arrival waits",
    )
    p.add_argument("--batch-clients", type=int, default=16, help="closed-loop batch clients (> max-num-seqs)")
    p.add_argument("--batch-prompt", type=int, default=128, help="tokens in each batch prompt")
    p.add_argument("--batch-tokens", type=int, default=48, help="tokens each batch request generates")
    p.add_argument("--batch-priority", type=int, default=30, help="the batch class's priority")
    p.add_argument("--realtime", type=int, default=12, help="realtime requests, one after another")
    p.add_argument("--realtime-prompt", type=int, default=32, help="tokens in each realtime prompt")
    p.add_argument("--realtime-tokens", type=int, default=16, help="tokens each realtime request generates")
    p.add_argument("--realtime-priority", type=int, default=90, help="the realtime class's priority")
    p.add_argument("--realtime-gap", type=float, default=0.5, help="seconds between realtime requests")
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="send each realtime request the moment the previous one finished (no --realtime-gap)",
    )
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI: priority and fcfs, 3 batch clients over 2 seats, 3 back-to-back realtime requests, a few tokens "
        "each (checks the script runs end to end; its figures mean nothing)",
    )
    args = p.parse_args()
    if args.smoke:
        args.policies, args.max_num_seqs, args.batch_clients, args.realtime = "priority,fcfs", 2, 3, 3
        args.batch_prompt, args.batch_tokens, args.realtime_prompt, args.realtime_tokens = 16, 6, 8, 3
        args.back_to_back = True
    from scheduler_node.engine.model_path import resolve_model

    model = resolve_model(args.model)
    rows = [run(model, "priority", args, with_batch=False)]
    rows += [run(model, policy, args, with_batch=True) for policy in args.policies.split(",")]
    unloaded = rows[0]["rt_ttft_p99"]
    print(
        "| policy | load | RT TTFT P50 | RT TTFT P99 | P99 / unloaded | RT e2e P50 | RT e2e P99 | batch worst TTFT "
        "| batch done | batch failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {'batch' if r['loaded'] else 'none'} | {r['rt_ttft_p50']:.3f} | "
            f"{r['rt_ttft_p99']:.3f} | {r['rt_ttft_p99'] / unloaded:.2f}x | {r['rt_e2e_p50']:.3f} | "
            f"{r['rt_e2e_p99']:.3f} | {r['batch_worst_ttft']:.2f} | {r['batch_done']} | {r['batch_failed']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
