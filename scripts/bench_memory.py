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
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from workload import greedy_spec, run_to_idle  # noqa: E402

from minivllm.cluster import Cluster  # noqa: E402
from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402
from scheduler_node.core.config import PreemptionMode, SchedulerConfig  # noqa: E402
from scheduler_node.core.stats import snapshot  # noqa: E402
from scheduler_node.engine.builder import make_engine  # noqa: E402
from scheduler_node.engine.stand_in import StandInWorkers  # noqa: E402
from scheduler_node.text.tokenizer import ModelTokenizer  # noqa: E402
from settings.engine import EngineConfig  # noqa: E402


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


def saturation(model: Path, num_blocks: int, block_size: int, max_model_len: int, n: int) -> dict:
    """The engine core over stand-in workers (no model): how full the blocks are held at saturation."""
    rng = random.Random(1)
    config = EngineConfig(
        scheduler=SchedulerConfig(
            block_size=block_size,
            max_num_batched_tokens=4096,
            max_num_seqs=1024,
            max_model_len=max_model_len,
            preemption_mode=PreemptionMode.RECOMPUTE,
        )
    )
    workers = StandInWorkers(num_blocks)
    engine = make_engine(config, model, ModelTokenizer(model), workers, workers.capacity)
    utilization, running = [], []

    def observe(plan: object) -> None:
        stats = snapshot(engine.scheduler)
        if stats.kv_usage >= 0.9:
            utilization.append(1 - stats.fragmentation)
            running.append(stats.num_running)

    workers.on_plan = observe
    specs = []
    for i in range(n):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(32, 512))]
        specs.append(greedy_spec(f"r{i}", prompt, rng.randint(16, 256)))
    asyncio.run(run_to_idle(engine, specs))
    static = num_blocks * block_size // max_model_len
    return {
        "kv_slot_utilization": statistics.mean(utilization),
        "mean_concurrent": statistics.mean(running),
        "static_max_len_concurrent": static,
        "concurrency_ratio": statistics.mean(running) / static,
        "preemptions": engine.scheduler.num_preemptions,
    }


def pressure(model: Path, mode: str, num_blocks: int, host_blocks: int, n: int) -> dict:
    """The offline API with few KV blocks: throughput and recomputation per preemption mode."""
    from minivllm import LLM, SamplingParams

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(64, 256))] for _ in range(n)]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(64, 128)) for _ in range(n)]
    with LLM(str(model), num_kv_blocks=num_blocks, preemption_mode=mode, max_num_batched_tokens=256) as llm:
        block_bytes = llm.engine.workers.capacity.bytes_per_block
        if llm.engine.scheduler.blocks.num_host_blocks < host_blocks:
            raise SystemExit(f"(c) needs {host_blocks * block_bytes / 2**30:.2f} GiB of swap space")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        c = llm.engine.scheduler.counters
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    needed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs)
    return {
        "mode": mode,
        "seconds": elapsed,
        "tok_s": generated / elapsed,
        # every token but each request's last sampled one is computed once; the rest is recomputation
        "recomputed_tokens": c.scheduled_tokens - needed,
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
        b = saturation(model, num_blocks=2048, block_size=16, max_model_len=2048, n=256)
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
