"""Soak: `vllm-serve` with its default flags (ports apart) under an open-loop mixed load (Poisson arrivals of
greedy and seeded requests, n > 1, shared system prompts, some cancelled by their clients) for --minutes, its
worker killed with SIGKILL every --kill-every minutes. At the end every request is accounted for — completed,
cancelled by its client, failed with a status, or lost (no end within --bound seconds) — and the table shows the
KV blocks free at idle and the scheduler's and worker's resident memory and open files after the warm-up and at
the end (a leak shows as growth; the bar is < 5 %).

    .venv/bin/python scripts/soak.py --minutes 20 [--json soak.json]   # docs/benchmarks.md's run (SmolLM2, defaults)
    .venv/bin/python scripts/soak.py --smoke --model FOLDER            # CI: under a minute, one kill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clients.bench.mixed import Outcome, mixed_requests, stream  # noqa: E402
from clients.bench.workload import arrival_times  # noqa: E402
from minivllm.cluster import ServeProcess  # noqa: E402
from scheduler_node.engine.model_path import resolve_model  # noqa: E402


@dataclass
class Usage:
    """Resident memory (MiB) and open files of the scheduler and the current worker."""

    scheduler_rss: float
    scheduler_fds: int
    worker_rss: float
    worker_fds: int


def usage(serve: ServeProcess) -> Usage | None:
    """None while no single worker is ready (between a kill and the replacement's start)."""
    children = psutil.Process(serve.proc.pid).children(recursive=True)
    scheduler = next(p for p in children if "scheduler_node.cli.scheduler" in " ".join(p.cmdline()))
    ready = serve.ready_pids()
    if len(ready) != 1:
        return None
    try:
        worker = psutil.Process(ready[0])
    except psutil.NoSuchProcess:
        return None
    mib = 1 << 20
    return Usage(scheduler.memory_info().rss / mib, scheduler.num_fds(), worker.memory_info().rss / mib,
                 worker.num_fds())  # fmt: skip


def median_usage(samples: list[Usage]) -> Usage:
    """Each field's median over `samples` (one sample taken mid-allocation should not decide the figure)."""
    fields = asdict(samples[0]).keys()
    return Usage(**{f: statistics.median(getattr(s, f) for s in samples) for f in fields})


class Soak:
    def __init__(self, serve: ServeProcess, args: argparse.Namespace) -> None:
        self.serve, self.args = serve, args
        duration = args.minutes * 60
        count = int(args.rate * duration * 2) + 10  # more than the arrivals can use
        self.pending = mixed_requests(random.Random(args.seed), count, (args.min_tokens, args.max_tokens))
        self.times = [t for t in arrival_times(count, args.rate, 1.0, args.seed) if t < duration]
        self.sent: list[Outcome] = []
        self.threads: list[threading.Thread] = []
        self.kills: list[float] = []  # seconds from a SIGKILL to the replacement's "ready"
        self.samples: list[tuple[float, Usage]] = []

    def send_all(self, start: float) -> None:
        for at, outcome in zip(self.times, self.pending):
            time.sleep(max(0.0, start + at - time.monotonic()))
            t = threading.Thread(target=stream, args=(self.serve.stub, outcome, self.args.bound), daemon=True)
            t.start()
            self.sent.append(outcome)
            self.threads.append(t)

    def kill_worker(self) -> None:
        (pid,) = self.serve.ready_pids()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 300:
            ready = self.serve.ready_pids()
            if ready and pid not in ready:
                self.kills.append(time.monotonic() - killed)
                return
            time.sleep(0.2)
        raise RuntimeError(f"no replacement worker within 300 s\n{self.serve.tail()}")

    def run(self) -> dict:
        args, start = self.args, time.monotonic()
        sender = threading.Thread(target=self.send_all, args=(start,), daemon=True)
        sender.start()
        next_kill = start + args.kill_every * 60
        while sender.is_alive():
            now = time.monotonic()
            if now >= next_kill:
                self.kill_worker()
                next_kill = time.monotonic() + args.kill_every * 60
            elif (sample := usage(self.serve)) is not None:
                self.samples.append((now - start, sample))
            time.sleep(min(5.0, max(0.1, next_kill - time.monotonic())))
        for t in self.threads:
            t.join(args.bound + 10)
        idle = self.wait_idle()
        end = median_usage([u for u in (usage(self.serve) for _ in range(3)) if u is not None])
        warm = args.warmup * 60
        baseline = [u for at, u in self.samples if warm <= at < warm + 60] or [self.samples[-1][1]]
        return self.summary(median_usage(baseline), end, idle, time.monotonic() - start)

    def wait_idle(self) -> dict:
        deadline = time.monotonic() + 60
        while True:
            s = self.serve.stats()
            if (s.num_running == s.num_waiting == 0 and s.free_blocks == s.total_blocks) or time.monotonic() > deadline:
                return {"free_blocks": s.free_blocks, "total_blocks": s.total_blocks, "running": s.num_running,
                        "waiting": s.num_waiting}  # fmt: skip
            time.sleep(0.5)

    def summary(self, start: Usage, end: Usage, idle: dict, seconds: float) -> dict:
        lost = [o for o, t in zip(self.sent, self.threads) if t.is_alive() or o.code == "DEADLINE_EXCEEDED"]
        ended = [o for o in self.sent if o not in lost]
        statuses = Counter(o.code for o in ended if o.code and not (o.cancel_after and o.code == "CANCELLED"))
        short = [o for o in ended if not o.code and any(len(t) != o.request.sampling.max_tokens
                                                        for t in o.tokens.values())]  # fmt: skip
        return {
            "seconds": round(seconds, 1),
            "sent": len(self.sent),
            "completed": sum(1 for o in ended if not o.code) - len(short),
            "cancelled_by_client": sum(1 for o in ended if o.cancel_after and o.code == "CANCELLED"),
            "failed": dict(statuses),
            "short": len(short),  # ended "normally" without their max_tokens (ignore_eos is set): a defect
            "lost": len(lost),
            "kills": len(self.kills),
            "rejoin_s": [round(k, 1) for k in self.kills],
            "idle": idle,
            "start": asdict(start),
            "end": asdict(end),
        }


def growth(a: float, b: float) -> str:
    return f"{100 * (b - a) / a:+.1f} %" if a else "n/a"


def print_table(r: dict) -> None:
    s, e = r["start"], r["end"]
    failed = ", ".join(f"{k} {v}" for k, v in r["failed"].items()) or "0"
    print("| sent | completed | cancelled by client | failed | short | lost | kills (rejoin s) | free blocks at idle |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {r['sent']} | {r['completed']} | {r['cancelled_by_client']} | {failed} | {r['short']} | {r['lost']} "
          f"| {r['kills']} ({', '.join(map(str, r['rejoin_s']))}) | {r['idle']['free_blocks']} / "
          f"{r['idle']['total_blocks']} |")  # fmt: skip
    print()
    print("| process | RSS after warm-up | RSS at end | growth | open files (start → end) |")
    print("|---|---|---|---|---|")
    for who in ("scheduler", "worker"):
        a, b = s[f"{who}_rss"], e[f"{who}_rss"]
        print(f"| {who} | {a:.0f} MiB | {b:.0f} MiB | {growth(a, b)} | {s[f'{who}_fds']:.0f} → {e[f'{who}_fds']:.0f} |")


def verdict(r: dict, smoke: bool) -> list[str]:
    """What the run shows is wrong (empty: every request accounted for, memory flat, blocks free)."""
    problems = []
    if r["lost"] or r["short"] or r["failed"]:
        problems.append(f"{r['lost']} lost, {r['short']} short, failed {r['failed']}")
    if r["idle"]["free_blocks"] != r["idle"]["total_blocks"] or r["idle"]["running"] or r["idle"]["waiting"]:
        problems.append(f"not idle at the end: {r['idle']}")
    s, e = r["start"], r["end"]
    if smoke:  # a minute is mostly warm-up: memory is judged on full runs only
        return problems
    if e["scheduler_rss"] > 1.05 * s["scheduler_rss"]:
        problems.append(f"scheduler RSS grew {growth(s['scheduler_rss'], e['scheduler_rss'])}")
    if e["scheduler_fds"] > s["scheduler_fds"] + 8:
        problems.append(f"scheduler open files grew {s['scheduler_fds']} → {e['scheduler_fds']}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default", help="model folder, file or hub id (default: SmolLM2-135M)")
    p.add_argument("--minutes", type=float, default=20.0, help="how long requests arrive")
    p.add_argument("--rate", type=float, default=1.0, help="mean requests per second (Poisson arrivals)")
    p.add_argument("--kill-every", type=float, default=4.0, help="minutes between SIGKILLs of the worker")
    p.add_argument("--warmup", type=float, default=2.0, help="minutes before the memory baseline is taken")
    p.add_argument("--min-tokens", type=int, default=16, help="shortest max_tokens of a request")
    p.add_argument("--max-tokens", type=int, default=128, help="longest max_tokens of a request")
    p.add_argument("--bound", type=float, default=300.0, help="seconds after which a request counts as lost")
    p.add_argument("--seed", type=int, default=0)
    smoke = "CI: 0.75 minutes at 1.6 requests/s, a kill after 0.3, the baseline after 0.15"
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    if args.smoke:
        args.minutes, args.kill_every, args.warmup, args.rate, args.max_tokens = 0.75, 0.3, 0.15, 1.6, 48
    with tempfile.TemporaryDirectory(prefix="soak-") as logs:
        serve = ServeProcess(resolve_model(args.model), Path(logs))
        try:
            serve.wait_serving()
            result = Soak(serve, args).run()
        finally:
            code = serve.stop()
        if code != 0:
            print(serve.tail(), file=sys.stderr)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    problems = verdict(result, args.smoke) + ([] if code == 0 else [f"vllm-serve exited with {code}"])
    for problem in problems:
        print("PROBLEM:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
