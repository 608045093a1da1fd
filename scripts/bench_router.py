"""Routing benchmark: a shared-prefix workload (several system prompts, many users each) through vllm-router over
two replicas, by `round_robin`, `least_loaded` and `prefix`, in one run, with one replica holding the same total
KV memory and threads as the reference (its cache sees every request, so it is the hit rate to approach).

Each strategy gets its own fresh system prompts (the replicas are shared, so no run finds another's blocks), sent
in a shuffled order by closed-loop clients. The KV cache of each replica holds 0.6 of all system prompts (counted
in full blocks of their tokens): a strategy that sends every prompt everywhere thrashes it, one that gives each
replica half keeps it. Reports
the replicas' prefix-cache hit rate (tokens found / tokens looked up, from their GetStats), the client's time to
first token and the requests each replica served.

    .venv/bin/python scripts/bench_router.py [--smoke] [--model DIR] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from clients.bench.report import bar_panels  # noqa: E402
from minivllm.cluster import Cluster, RouterProcess  # noqa: E402
from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402
from scheduler_node.text.tokenizer import ModelTokenizer  # noqa: E402
from settings.router import DEFAULT_LOAD_FACTOR  # noqa: E402

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part"
).split()
NAME = "m"  # the served model name of every replica
SMOKE = {"system_prompts": 32, "users": 4, "clients": 4, "cache_share": 0.7}


@dataclass(frozen=True)
class Workload:
    system_prompts: int
    users: int
    system_words: int
    user_words: int
    max_tokens: int
    clients: int

    def system(self, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(rng.choice(WORDS) for _ in range(self.system_words)) for _ in range(self.system_prompts)]

    def requests(self, seed: int) -> list[str]:
        """Every user's prompt, shuffled: system prompt `i` then the user's own question."""
        rng = random.Random(f"users {seed}")
        prompts = [
            f"{system}\nUser {u}: " + " ".join(rng.choice(WORDS) for _ in range(self.user_words))
            for system in self.system(seed)
            for u in range(self.users)
        ]
        rng.shuffle(prompts)
        return prompts

    def kv_blocks(self, tokenizer: ModelTokenizer, cache_share: float, block_size: int) -> int:
        """A replica's KV blocks: `cache_share` of the full blocks of every system prompt, plus room for the
        clients' own blocks."""
        system = sum(len(tokenizer.encode(text)) // block_size for text in self.system(0))
        own = len(tokenizer.encode(self.requests(0)[0])) - len(tokenizer.encode(self.system(0)[0]))
        return int(cache_share * system) + self.clients * ((own + self.max_tokens) // block_size + 2)


def prefix_cache(channels: list[grpc.Channel]) -> tuple[int, int]:
    """(tokens looked up, tokens found) summed over the replicas."""
    stats = [pb_grpc.ControlStub(c).GetStats(pb.GetStatsRequest(), timeout=10) for c in channels]
    return sum(s.prefix_cache_queries for s in stats), sum(s.prefix_cache_hits for s in stats)


def drive(channel: grpc.Channel, prompts: list[str], workload: Workload) -> list[float]:
    """Send every prompt from `workload.clients` closed-loop clients; each request's time to first token."""
    stub = pb_grpc.GenerationStub(channel)
    todo = list(reversed(prompts))
    ttfts: list[float] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            request = pb.GenerateRequest(
                prompt=prompt,
                sampling=pb.SamplingParams(max_tokens=workload.max_tokens, temperature=0, ignore_eos=True),
            )
            start = time.perf_counter()
            first = 0.0
            for delta in stub.Generate(request, timeout=600):
                if delta.token_ids and not first:
                    first = time.perf_counter() - start
            with lock:
                ttfts.append(first)

    threads = [threading.Thread(target=client) for _ in range(workload.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts


def measure(
    setup: str, strategy: str, replicas: list[Cluster], workload: Workload, seed: int, load_factor: float
) -> dict:
    flags = ["--routing-strategy", strategy, "--routing-load-factor", str(load_factor)]
    router = RouterProcess([f"{c.address},model={NAME}" for c in replicas], flags)
    try:
        router.wait_serving(60)
        channels = [c.channel for c in replicas]
        queries, hits = prefix_cache(channels)
        start = time.perf_counter()
        ttfts = drive(router.channel, workload.requests(seed), workload)
        wall = time.perf_counter() - start
        queries, hits = (a - b for a, b in zip(prefix_cache(channels), (queries, hits)))
        listed = pb_grpc.ControlStub(router.channel).ListReplicas(pb.ListReplicasRequest(), timeout=10)
    finally:
        router.stop()
    ordered = sorted(ttfts)
    return {
        "setup": setup,
        "strategy": strategy if strategy != "prefix" else f"prefix, load factor {load_factor:g}",
        "requests": len(ttfts),
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p90": ordered[int(0.9 * (len(ordered) - 1))],
        "wall_s": wall,
        "per_replica": [r.requests for r in listed.replicas],
    }


def warm_up(replicas: list[Cluster], workload: Workload) -> None:
    """A few requests on each replica first (allocations, kernels), with prompts no measured run uses."""
    for c in replicas:
        drive(c.channel, Workload(2, 2, workload.system_words, workload.user_words, 2, 2).requests(999), workload)


def plot(rows: list[dict], path: Path) -> None:
    labels = [f"{r['setup']}\n{r['strategy']}" for r in rows]
    bar_panels(
        path,
        labels,
        [([r["hit_rate"] for r in rows], "prefix-cache hit rate"), ([r["ttft_mean"] for r in rows], "mean TTFT (s)")],
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--smoke", action="store_true", help="a small workload (CI): 32 system prompts x 4 users, 4 clients")
    p.add_argument("--system-prompts", type=int, default=32)
    p.add_argument("--users", type=int, default=5, help="requests per system prompt")
    p.add_argument("--system-words", type=int, default=100, help="words of each system prompt")
    p.add_argument("--user-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    p.add_argument(
        "--cache-share", type=float, default=0.6, help="a replica's KV blocks / the blocks of all system prompts"
    )
    p.add_argument(
        "--load-factors",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[DEFAULT_LOAD_FACTOR],
        help="prefix: one run per --routing-load-factor (comma-separated; default: the router's)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="also write bar charts here (PNG, needs matplotlib)")
    args = p.parse_args()
    if args.smoke:  # its own defaults; flags still win
        p.set_defaults(**SMOKE)
        args = p.parse_args()
    from scheduler_node.engine.model_path import resolve_model

    model = resolve_model(args.model)
    workload = Workload(
        args.system_prompts, args.users, args.system_words, args.user_words, args.max_tokens, args.clients
    )
    block_size = 16
    blocks = workload.kv_blocks(ModelTokenizer(model), args.cache_share, block_size)
    common = ["--served-model-name", NAME, "--block-size", str(block_size)]
    pair = [Cluster(model, [*common, "--num-kv-blocks", str(blocks)], ["--threads", "1"]) for _ in range(2)]
    single = Cluster(model, [*common, "--num-kv-blocks", str(2 * blocks)], ["--threads", "2"])
    try:
        for c in [*pair, single]:
            c.wait_serving()
        warm_up([*pair, single], workload)
        rows = [measure("1 replica, 2x KV", "round_robin", [single], workload, 1, DEFAULT_LOAD_FACTOR)]
        runs = [("round_robin", DEFAULT_LOAD_FACTOR), ("least_loaded", DEFAULT_LOAD_FACTOR)] + [
            ("prefix", f) for f in args.load_factors
        ]
        for seed, (strategy, factor) in enumerate(runs, start=2):
            rows.append(measure("2 replicas", strategy, pair, workload, seed, factor))
    finally:
        for c in [*pair, single]:
            c.stop()
    print(
        f"{workload.system_prompts} system prompts x {workload.users} users, {args.system_words} words each, "
        f"{workload.clients} clients; {blocks} KV blocks per replica ({args.cache_share:g} of the system prompts)"
    )
    print("| setup | strategy | hit rate | mean TTFT (s) | P90 TTFT (s) | wall (s) | requests per replica |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setup']} | {r['strategy']} | {r['hit_rate']:.2f} | {r['ttft_mean']:.3f} | {r['ttft_p90']:.3f} | "
            f"{r['wall_s']:.1f} | {' / '.join(map(str, r['per_replica']))} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
