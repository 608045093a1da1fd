"""Disaggregated prefill/decode vs colocated data parallelism, on the same two replicas (the same cores), in one run.

Two vllm-scheduler replicas of one model, one worker each with the same threads. Colocated: a router spreads every
request over both (`least_loaded`), so a long prompt's prefill shares steps with the decode streams on its replica.
Disaggregated: a router with `--disaggregate` computes every prompt on replica A (kv_role=prefill) and generates on
replica B (kv_role=decode), which pulls the prompt's KV from A's worker over the KV transfer socket; a prompt shorter
than the router's --disaggregate-min-prompt-tokens (this script's --min-prompt-tokens) goes straight to B. The two modes
alternate round by round (A, B, A, B, ...) over fresh prompts, so machine load drifts hit both alike.

The workload of a round: `--streams` decode-heavy chat streams (short prompts, `--stream-tokens` output tokens each)
start at once, and `--long` requests with `--long-prompt` token prompts and `--long-tokens` outputs arrive at random
(Poisson) while they run. Reported per mode: time to first token (P50/P99, of the long requests and of all), the
decode streams' inter-token latency (P50/P99 of every gap), and goodput: requests per second that met the SLO
(TTFT <= --slo-ttft and every inter-token gap <= --slo-itl).

    .venv/bin/python scripts/bench_disagg.py [--smoke] [--model DIR] [--rounds N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minivllm.cluster import Cluster, RouterProcess  # noqa: E402
from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402

NAME = "m"
MODES = ("colocated", "disaggregated")
SMOKE = {"streams": 2, "stream_tokens": 12, "long": 2, "long_prompt": 120, "long_tokens": 4, "rounds": 1,
         "rate": 4.0}  # fmt: skip


@dataclass(slots=True)
class Record:
    kind: str  # "stream" or "long"
    sent: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each token
    error: str = ""
    cached: int = 0  # prompt tokens the serving replica did not compute (its prefix cache, or pulled KV)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


@dataclass(frozen=True, slots=True)
class Workload:
    streams: int
    stream_prompt: int
    stream_tokens: int
    long: int
    long_prompt: int
    long_tokens: int
    rate: float  # long requests per second

    def plan(self, seed: int, vocab: int) -> list[tuple[float, str, list[int], int]]:
        """(send time, kind, prompt ids, max tokens) of a round, fresh prompts per seed."""
        rng = random.Random(seed)
        ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
        items = [(0.05 * i, "stream", ids(self.stream_prompt), self.stream_tokens) for i in range(self.streams)]
        at = 0.2
        for _ in range(self.long):
            at += rng.expovariate(self.rate)
            items.append((at, "long", ids(self.long_prompt), self.long_tokens))
        return items


def one(stub: pb_grpc.GenerationStub, rec: Record, prompt: list[int], max_tokens: int) -> None:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    rec.sent = time.perf_counter()
    try:
        for response in stub.Generate(request, timeout=600):
            now = time.perf_counter()
            rec.times += [now] * len(response.token_ids)
            if response.finish_reason:
                rec.cached = response.usage.cached_tokens
    except Exception as exc:  # noqa: BLE001 - reported in the table
        rec.error = str(exc)


def run_round(router: RouterProcess, items: list[tuple[float, str, list[int], int]]) -> tuple[list[Record], float]:
    stub = pb_grpc.GenerationStub(router.channel)
    records = [Record(kind) for _, kind, _, _ in items]
    start = time.perf_counter()
    threads = []
    for (at, _, prompt, max_tokens), rec in zip(items, records):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # open loop: the arrival schedule, not a wait on the server
        t = threading.Thread(target=one, args=(stub, rec, prompt, max_tokens))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return records, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(mode: str, rounds: list[tuple[list[Record], float]], slo_ttft: float, slo_itl: float) -> dict:
    records = [r for rs, _ in rounds for r in rs]
    ok = [r for r in records if not r.error and r.times]
    wall = sum(w for _, w in rounds)
    gaps = [g for r in ok if r.kind == "stream" for g in r.gaps]
    met = [r for r in ok if r.ttft <= slo_ttft and all(g <= slo_itl for g in r.gaps)]
    return {
        "mode": mode,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50": pct([r.ttft for r in ok], 0.5),
        "ttft_p99": pct([r.ttft for r in ok], 0.99),
        "long_ttft_p50": pct([r.ttft for r in ok if r.kind == "long"], 0.5),
        "long_ttft_p99": pct([r.ttft for r in ok if r.kind == "long"], 0.99),
        "itl_p50": pct(gaps, 0.5),
        "itl_p99": pct(gaps, 0.99),
        "itl_mean": statistics.mean(gaps) if gaps else float("nan"),
        "long_cached_tokens": sum(r.cached for r in ok if r.kind == "long"),
        "goodput": len(met) / wall if wall else 0.0,
        "slo_met": len(met),
        "wall_s": wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--smoke", action="store_true", help=f"a small workload (CI): {SMOKE}")
    p.add_argument("--streams", type=int, default=4, help="decode streams per round")
    p.add_argument("--stream-prompt", type=int, default=32, help="prompt tokens of a decode stream")
    p.add_argument("--stream-tokens", type=int, default=96, help="output tokens of a decode stream")
    p.add_argument("--long", type=int, default=4, help="long-prompt requests per round")
    p.add_argument("--long-prompt", type=int, default=2048, help="prompt tokens of a long request")
    p.add_argument("--long-tokens", type=int, default=8, help="output tokens of a long request")
    p.add_argument("--rate", type=float, default=0.5, help="long requests per second (Poisson)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each replica's worker")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds: goodput counts requests under it")
    p.add_argument("--slo-itl", type=float, default=0.5, help="seconds: and every inter-token gap under this")
    p.add_argument(
        "--min-prompt-tokens",
        type=int,
        help="the disaggregating router's --disaggregate-min-prompt-tokens (default: the router's; 0 moves every "
        "prompt, the decode streams' too)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.smoke:  # its own defaults; flags still win
        p.set_defaults(**SMOKE)
        args = p.parse_args()
    from scheduler_node.engine.model_path import resolve_model

    model = resolve_model(args.model)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    workload = Workload(args.streams, args.stream_prompt, args.stream_tokens, args.long, args.long_prompt,
                        args.long_tokens, args.rate)  # fmt: skip
    # --step-timeout: on a shared, overloaded CPU a long prompt's step can outrun the default deadline; this measures
    # latency, not the failure model (a lost rank here has no launcher to replace it).
    scheduler = ["--served-model-name", NAME, "--step-timeout", "600"]
    replicas = [Cluster(model, scheduler, ["--threads", str(args.threads)]) for _ in range(2)]
    a, b = (c.address for c in replicas)
    disaggregate = ["--disaggregate"]
    if args.min_prompt_tokens is not None:
        disaggregate += ["--disaggregate-min-prompt-tokens", str(args.min_prompt_tokens)]
    routers = {
        "colocated": RouterProcess([f"{a},model={NAME}", f"{b},model={NAME}"], ["--routing-strategy", "least_loaded"]),
        "disaggregated": RouterProcess(
            [f"{a},model={NAME},kv_role=prefill", f"{b},model={NAME},kv_role=decode"], disaggregate
        ),
    }
    results: dict[str, list[tuple[list[Record], float]]] = {m: [] for m in MODES}
    try:
        for c in replicas:
            c.wait_serving(600)  # a model load on a shared, loaded CPU can take minutes
        for r in routers.values():
            r.wait_serving(60)
        warm = Workload(1, 8, 2, 1, 40, 2, 10.0)
        for mode in MODES:  # allocations and kernels warmed with prompts no measured round uses
            run_round(routers[mode], warm.plan(10_000, vocab))
        for i in range(args.rounds):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                results[mode].append(run_round(routers[mode], workload.plan(2 * i + MODES.index(mode), vocab)))
    finally:
        for r in routers.values():
            r.stop()
        for c in replicas:
            c.stop()
    rows = [summarize(m, results[m], args.slo_ttft, args.slo_itl) for m in MODES]
    load = os.getloadavg()[0]
    w = workload
    print(
        f"{args.rounds} round(s) per mode, alternating; each: {w.streams} decode streams ({w.stream_prompt}-token "
        f"prompts, {w.stream_tokens} tokens) and {w.long} requests of {w.long_prompt}-token prompts "
        f"({w.long_tokens} tokens) at {w.rate:g}/s; 2 replicas x {args.threads} thread(s); "
        f"SLO TTFT <= {args.slo_ttft:g} s, ITL <= {args.slo_itl:g} s; load average {load:.1f}"
    )
    print("| mode | TTFT P50 (s) | TTFT P99 (s) | long TTFT P50 (s) | ITL P50 (ms) | ITL P99 (ms) | goodput (req/s) | "
          "errors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['ttft_p50']:.3f} | {row['ttft_p99']:.3f} | {row['long_ttft_p50']:.3f} | "
            f"{row['itl_p50'] * 1e3:.1f} | {row['itl_p99'] * 1e3:.1f} | {row['goodput']:.2f} | {row['errors']} |"
        )
    co, dis = rows
    itl_ratio = dis["itl_p99"] / co["itl_p99"] if co["itl_p99"] else float("nan")
    ttft_ratio = dis["ttft_p50"] / co["ttft_p50"] if co["ttft_p50"] else float("nan")
    print(f"disaggregated / colocated: ITL P99 {itl_ratio:.2f} (bar <= 0.5), TTFT P50 {ttft_ratio:.2f} (bar <= 1.5)")
    if args.json:
        summary = {"rows": rows, "load_average": load, "itl_p99_ratio": itl_ratio, "ttft_p50_ratio": ttft_ratio}
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
