"""KV-aware routing benchmark: `kv` vs `prefix` vs `round_robin` through vllm-router over replicas that publish
their KV events (`--replicas`, 4 by default: 2 in --smoke), on a multi-tenant shared-prefix workload, in one run.

Every prompt is a platform-wide preamble (longer than `prefix`'s 256-character window, as instructions shared by
every tenant often are), then its tenant's own long context (system prompt and documents), then a user's question.
Tenants x users requests go in a shuffled order from closed-loop clients. Each replica's KV cache holds
`--cache-share` of all tenant contexts (by default 1 / replicas: the fleet holds each context once): a router that
gives each tenant one replica keeps them cached, one that spreads a tenant over several thrashes (and finds a
context where it sent it by chance: about one time in `--replicas`). `prefix` hashes the first 256 characters,
which are the preamble for all, so it sees one key (its load cap then spills tenants at random); `kv` sees the
blocks each replica holds. Each strategy gets its own preamble and tenants (no run finds another's blocks).

Reports the replicas' prefix-cache hit rate (tokens found / tokens looked up, their GetStats), the client's time to
first token, and throughput (requests and output tokens per second of the run).

    .venv/bin/python scripts/bench_kv_routing.py [--smoke] [--model DIR] [--replicas N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_router import WORDS, drive, prefix_cache  # noqa: E402

from minivllm.cluster import Cluster, RouterProcess, free_port  # noqa: E402
from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402
from scheduler_node.text.tokenizer import ModelTokenizer  # noqa: E402
from settings.router import DEFAULT_OVERLAP_WEIGHT  # noqa: E402

NAME = "m"
STRATEGIES = ("kv", "prefix", "round_robin")
SMOKE = {"tenants": 12, "max_tokens": 4, "replicas": 2}  # 2 replicas: the fewest processes CI can route between


@dataclass(frozen=True)
class Workload:
    tenants: int
    users: int
    preamble_words: int
    tenant_words: int
    user_words: int
    max_tokens: int
    clients: int

    def contexts(self, seed: int) -> tuple[str, list[str]]:
        rng = random.Random(f"tenants {seed}")
        preamble = "Platform rules: " + " ".join(rng.choice(WORDS) for _ in range(self.preamble_words))
        tenants = [f"Tenant {t}: " + " ".join(rng.choice(WORDS) for _ in range(self.tenant_words))
                   for t in range(self.tenants)]  # fmt: skip
        return preamble, tenants

    def requests(self, seed: int) -> list[str]:
        rng = random.Random(f"users {seed}")
        preamble, tenants = self.contexts(seed)
        prompts = [
            f"{preamble}\n{tenant}\nUser {u}: " + " ".join(rng.choice(WORDS) for _ in range(self.user_words))
            for tenant in tenants
            for u in range(self.users)
        ]
        rng.shuffle(prompts)
        return prompts

    def kv_blocks(self, tokenizer: ModelTokenizer, cache_share: float, block_size: int, replicas: int) -> int:
        """A replica's blocks: the preamble's, `cache_share` of all tenant contexts' (what stays cached), and each
        running request of its share of the clients (a tenant context and its own tail; a replica that gets more
        makes them wait or preempts)."""
        preamble, tenants = self.contexts(0)
        shared = len(tokenizer.encode(preamble)) // block_size
        tenant = sum(len(tokenizer.encode(f"{preamble}\n{t}")) // block_size - shared for t in tenants)
        own = (3 * self.user_words + self.max_tokens) // block_size + 2
        return shared + int(cache_share * tenant) + (self.clients // replicas + 1) * (tenant // len(tenants) + own)


def measure(strategy: str, replicas: list[Cluster], events: list[tuple[int, int]], model: Path,
            workload: Workload, seed: int, flags: list[str], label: str = "") -> dict:  # fmt: skip
    specs = [
        f"{c.address},model={NAME},kv_events=127.0.0.1:{e},kv_snapshot=127.0.0.1:{s},tokenizer={model}"
        for c, (e, s) in zip(replicas, events)
    ]
    metrics_port = free_port()
    router = RouterProcess(specs, ["--routing-strategy", strategy, "--metrics-port", str(metrics_port), *flags])
    try:
        router.wait_serving(300)  # a loaded shared CPU can take minutes to start one
        channels = [c.channel for c in replicas]
        before = prefix_cache(channels)
        start = time.perf_counter()
        ttfts = drive(router.channel, workload.requests(seed), workload)  # type: ignore[arg-type]
        wall = time.perf_counter() - start
        queries, hits = (a - b for a, b in zip(prefix_cache(channels), before))
        listed = pb_grpc.ControlStub(router.channel).ListReplicas(pb.ListReplicasRequest(), timeout=10)
        decisions = routing_decisions(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        router.stop()
    ordered = sorted(ttfts)
    return {
        "strategy": label or strategy,
        "requests": len(ttfts),
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p90": ordered[int(0.9 * (len(ordered) - 1))],
        "wall_s": wall,
        "requests_per_s": len(ttfts) / wall,
        "output_tokens_per_s": len(ttfts) * workload.max_tokens / wall,
        "per_replica": [r.requests for r in listed.replicas],
        "decisions": decisions,
    }


def routing_decisions(url: str) -> dict[str, int]:
    """The router's decisions by outcome (kv: overlap, load, least; prefix: affinity, overflow)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        s.labels["decision"]: int(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "minivllm:router_decisions_total"
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--smoke", action="store_true", help=f"a small workload (CI): {SMOKE}")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--users", type=int, default=8, help="requests per tenant")
    p.add_argument("--preamble-words", type=int, default=60, help="words of the preamble every tenant shares")
    p.add_argument("--tenant-words", type=int, default=300, help="words of each tenant's own context")
    p.add_argument("--user-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients")
    p.add_argument("--replicas", type=int, default=4,
                   help="replicas (1 thread each); with 2, chance finds half of each context")  # fmt: skip
    p.add_argument("--cache-share", type=float, default=None,
                   help="a replica's KV blocks / all tenant contexts' blocks (default: 1 / replicas)")  # fmt: skip
    p.add_argument("--kv-overlap-weight", type=weights, default=[DEFAULT_OVERLAP_WEIGHT],
                   help="the kv router's; several (comma-separated): one kv row each, in the same run")  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.smoke:  # its own defaults; flags still win
        p.set_defaults(**SMOKE)
        args = p.parse_args()
    from scheduler_node.engine.model_path import resolve_model

    if args.replicas < 2:
        p.error(f"--replicas must be >= 2 (routing needs a choice), got {args.replicas}")
    cache_share = 1 / args.replicas if args.cache_share is None else args.cache_share
    model = resolve_model(args.model)
    workload = Workload(args.tenants, args.users, args.preamble_words, args.tenant_words, args.user_words,
                        args.max_tokens, args.clients)  # fmt: skip
    block_size = 16
    blocks = workload.kv_blocks(ModelTokenizer(model), cache_share, block_size, args.replicas)
    events = [(free_port(), free_port()) for _ in range(args.replicas)]
    replicas = [
        Cluster(model, ["--served-model-name", NAME, "--step-timeout", "600",  # an overloaded CPU: no lost rank
                        "--block-size", str(block_size), "--num-kv-blocks", str(blocks),
                        "--kv-events-port", str(e), "--kv-events-snapshot-port", str(s)], ["--threads", "1"])
        for e, s in events
    ]  # fmt: skip
    try:
        for c in replicas:
            c.wait_serving()
        for c in replicas:  # warm up (allocations, kernels) with prompts no measured run uses
            warm = Workload(2, 2, 8, 8, 4, 2, 2)
            drive(c.channel, warm.requests(999), warm)  # type: ignore[arg-type]
        runs = [("kv", f"kv w={w:g}" if i else "kv", w) for i, w in enumerate(args.kv_overlap_weight)]
        runs += [(s, s, DEFAULT_OVERLAP_WEIGHT) for s in STRATEGIES[1:]]
        rows = [
            measure(s, replicas, events, model, workload, seed, ["--kv-overlap-weight", str(w)], label)
            for seed, (s, label, w) in enumerate(runs, 1)
        ]
    finally:
        for c in replicas:
            c.stop()
    load = os.getloadavg()[0]
    print(
        f"{workload.tenants} tenants x {workload.users} users ({args.preamble_words}-word shared preamble, "
        f"{args.tenant_words}-word tenant contexts), {workload.clients} clients, {args.replicas} replicas x 1 thread, "
        f"{blocks} KV blocks each ({cache_share:.2g} of the tenant contexts); load average {load:.1f}"
    )
    print("| strategy | hit rate | mean TTFT (s) | P90 TTFT (s) | requests/s | output tokens/s | per replica | "
          "decisions |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['strategy']} | {r['hit_rate']:.2f} | {r['ttft_mean']:.3f} | {r['ttft_p90']:.3f} | "
            f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {' / '.join(map(str, r['per_replica']))} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(r['decisions'].items()))} |"
        )
    by = {r["strategy"]: r for r in rows}
    base = by["prefix"]["hit_rate"]
    ratios = {r["strategy"]: r["hit_rate"] / base if base else float("inf") for r in rows if r["strategy"][:2] == "kv"}
    for name, ratio in ratios.items():
        print(f"{name} hit rate / prefix hit rate: {ratio:.2f} (bar: >= 1.5)")
    ratio = ratios["kv"]
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load_average": load, "kv_over_prefix": ratio}, indent=2))
    return 0


def weights(text: str) -> list[float]:
    return [float(w) for w in text.split(",")]


if __name__ == "__main__":
    sys.exit(main())
