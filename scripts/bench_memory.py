"""Memory-manager benchmark, in one run, on SmolLM2-135M (CPU by default):

(a) 32 requests sharing a 1,024-token system prompt, through a real scheduler + worker over gRPC: mean TTFT and
    throughput with prefix caching on vs off (the cache is warmed by one earlier request, as on a live server).
(b) KV slot utilization at saturation (1 - fragmentation) and concurrent requests held, vs a static max-length
    allocation of the same memory. This part measures the block table alone, driven by a stand-in worker that
    returns one token per sequence per step: the model does not change how blocks are held.
(c) Throughput under memory pressure with recompute vs swap vs elastic preemption (real model, in-process).

    .venv/bin/python scripts/bench_memory.py [--json out.json]
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402
from proto.wire import SamplingOptions, StepResult  # noqa: E402
from scheduler_node.core.config import SchedulerConfig  # noqa: E402
from scheduler_node.core.request import Request, StopConditions  # noqa: E402
from scheduler_node.core.scheduler import Scheduler  # noqa: E402
from scheduler_node.core.stats import snapshot  # noqa: E402
from tests.servers import Cluster  # noqa: E402


def shared_prefix(model: Path, caching: bool, n: int, system_len: int) -> dict:
    rng = random.Random(0)
    system = [rng.randrange(3, 49152) for _ in range(system_len)]
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    cluster = Cluster(model, [flag, "--max-num-batched-tokens", "2048"], ["--kv-cache-memory", "4GiB"])
    try:
        cluster.wait_serving()
        stub = pb_grpc.GenerationStub(cluster.channel)

        def request(suffix_seed: int) -> pb.GenerateRequest:
            r = random.Random(suffix_seed)
            ids = system + [r.randrange(3, 49152) for _ in range(16)]
            sampling = pb.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling)

        list(stub.Generate(request(-1), timeout=600))  # warm-up: the system prompt is now cached (if enabled)
        ttft = [0.0] * n
        tokens = [0] * n
        start = time.perf_counter()

        def one(i: int) -> None:
            t0 = time.perf_counter()
            for delta in stub.Generate(request(i), timeout=1200):
                if delta.token_ids and not ttft[i]:
                    ttft[i] = time.perf_counter() - t0
                tokens[i] += len(delta.token_ids)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        hit_rate = pb_grpc.ControlStub(cluster.channel).GetStats(pb.GetStatsRequest()).prefix_cache_hit_rate
    finally:
        cluster.stop()
    return {
        "prefix_caching": caching,
        "mean_ttft_s": statistics.mean(ttft),
        "p90_ttft_s": sorted(ttft)[int(0.9 * n) - 1],
        "tok_s": sum(tokens) / elapsed,
        "hit_rate": hit_rate,
    }


def saturation(num_blocks: int, block_size: int, max_model_len: int, n: int) -> dict:
    rng = random.Random(1)
    config = SchedulerConfig(
        block_size=block_size,
        max_num_batched_tokens=4096,
        max_num_seqs=1024,
        max_model_len=max_model_len,
        preemption_mode="recompute",
    )
    s = Scheduler(config, num_blocks)
    for i in range(n):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(32, 512))]
        s.add(Request(f"r{i}", prompt, SamplingOptions(0.0), StopConditions(rng.randint(16, 256))))
    utilization, running = [], []
    while s.has_work:
        plan = s.schedule()
        sampled = {
            r: [7] for r in plan.num_scheduled_tokens if s.requests[r].num_computed_tokens == s.requests[r].num_tokens
        }
        s.update(plan, StepResult(plan.step_id, sampled))
        stats = snapshot(s)
        if stats.kv_usage >= 0.9:
            utilization.append(1 - stats.fragmentation)
            running.append(stats.num_running)
    static = num_blocks * block_size // max_model_len
    return {
        "kv_slot_utilization": statistics.mean(utilization),
        "mean_concurrent": statistics.mean(running),
        "static_max_len_concurrent": static,
        "concurrency_ratio": statistics.mean(running) / static,
        "preemptions": s.num_preemptions,
    }


def pressure(model: Path, mode: str, num_blocks: int, host_blocks: int, n: int) -> dict:
    from tests.harness import OfflineEngine, make_runner

    rng = random.Random(2)
    runner = make_runner(model, num_blocks, 16, num_host_blocks=host_blocks)
    engine = OfflineEngine(runner, num_blocks, host_blocks, max_num_batched_tokens=256, preemption_mode=mode)
    from worker_node.kv_cache import measure_swap_bandwidth

    engine.scheduler.costs.bytes_per_block = runner.kv_cache[0][0][0].numel() * 4 * 2 * len(runner.kv_cache)
    engine.scheduler.costs.swap_bytes_per_s = measure_swap_bandwidth(
        runner.kv_cache, runner.host_cache, engine.scheduler.costs.bytes_per_block
    )
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(64, 256))]
        reqs += engine.add(prompt, rng.randint(64, 128))
    start = time.perf_counter()
    engine.run()
    elapsed = time.perf_counter() - start
    c = engine.scheduler.counters
    generated = sum(len(r.output_token_ids) for r in reqs)
    return {
        "mode": mode,
        "seconds": elapsed,
        "tok_s": generated / elapsed,
        # every token but each request's last sampled one is computed once; the rest is recomputation
        "recomputed_tokens": sum(p.total_tokens for p in engine.plans) - sum(r.num_tokens - 1 for r in reqs),
        "preemptions_recompute": c.preemptions_recompute,
        "preemptions_swap": c.preemptions_swap,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from scheduler_node.engine.model_path import resolve_model

    model = resolve_model(args.model)
    skip = set(args.skip.split(","))
    report: dict = {}
    if "a" not in skip:
        on, off = shared_prefix(model, True, 32, 1024), shared_prefix(model, False, 32, 1024)
        report["a"] = {"on": on, "off": off, "ttft_speedup": off["mean_ttft_s"] / on["mean_ttft_s"]}
        print("(a) shared 1,024-token system prompt, 32 requests")
        print("| prefix caching | mean TTFT s | P90 TTFT s | tok/s | hit rate |\n|---|---|---|---|---|")
        for r in (on, off):
            print(
                f"| {'on' if r['prefix_caching'] else 'off'} | {r['mean_ttft_s']:.2f} | {r['p90_ttft_s']:.2f} "
                f"| {r['tok_s']:.1f} | {r['hit_rate']:.2f} |"
            )
        print(f"TTFT speed-up: {report['a']['ttft_speedup']:.1f}x\n", flush=True)
    if "b" not in skip:
        b = saturation(num_blocks=2048, block_size=16, max_model_len=2048, n=256)
        report["b"] = b
        print("(b) saturation: 2,048 blocks of 16 tokens, 256 requests (prompts 32-512, outputs 16-256)")
        print(
            f"KV slot utilization {b['kv_slot_utilization']:.3f}; concurrent requests {b['mean_concurrent']:.1f} "
            f"vs {b['static_max_len_concurrent']} with static 2,048-token slots = {b['concurrency_ratio']:.1f}x\n",
            flush=True,
        )
    if "c" not in skip:
        rows = [pressure(model, mode, 64, 256, 12) for mode in ("recompute", "swap", "elastic")]
        report["c"] = rows
        print("(c) memory pressure: 64 KV blocks, 12 requests (prompts 64-256, outputs 64-128)")
        print("| mode | seconds | output tok/s | tokens recomputed | by recompute | by swap |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['mode']} | {r['seconds']:.1f} | {r['tok_s']:.1f} | {r['recomputed_tokens']} "
                f"| {r['preemptions_recompute']} | {r['preemptions_swap']} |"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
