"""Live-migration benchmark: a rolling restart of one of two replicas behind vllm-router, under load, without and
with migration, in one run.

Streams (greedy and seeded, half of them on each replica by round robin) run through the router; once each has
its first tokens, replica A is drained and stopped as a rolling upgrade does it:
- **stop**: SIGTERM; A drains for at most `--grace` seconds (its --shutdown-timeout: a pod's termination grace),
  then what it still runs is cut (the client gets UNAVAILABLE).
- **drain --migrate, then stop**: `Control.Drain(migrate=true)` hands A's streams to the router, which resumes
  them on B; then SIGTERM.
A comes back between the two runs. Reports streams completed and cut, each stream's largest gap between two
tokens (the client's view of the hand-off), and the time from the start of the drain until A exited. With
`--openai` the streams are OpenAI completions through the router's HTTP door (server-sent events) instead of gRPC.
With `--serve` the pair is one `vllm-serve --data-parallel-size 2` and the restart its own (SIGHUP: both replicas,
one at a time, drained with migrate and started again); "drain to exit" is then the whole round, until the second
replica serves again.

    .venv/bin/python scripts/bench_migrate.py [--smoke] [--openai] [--serve] [--model DIR] [--json out.json]
        [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from clients.bench.report import bar_panels  # noqa: E402
from minivllm.cluster import Cluster, RouterProcess, free_port  # noqa: E402
from proto import serving_pb2 as pb  # noqa: E402
from proto import serving_pb2_grpc as pb_grpc  # noqa: E402

NAME = "m"
SMOKE = {"streams": 8, "max_tokens": 64, "grace": 0.5, "kv_cache_memory": "16MiB"}


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)  # when each message with tokens came
    tokens: int = 0
    error: str = ""

    @property
    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


class ServeProcess:
    """`vllm-serve --data-parallel-size 2` on free loopback ports: its router's gRPC at .channel, its OpenAI API at
    .base_url; its log (and its children's) in .log."""

    def __init__(self, model: Path, flags: list[str], openai: bool) -> None:
        port, http_port = free_port(), free_port() if openai else 0
        self.base_url = f"http://127.0.0.1:{http_port}/v1" if openai else ""
        self.log = Path(tempfile.mkstemp(suffix=".log")[1])
        argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(model), "--data-parallel-size", "2",
                "--grpc-port", str(port), "--worker-port", str(free_port()), "--port", str(http_port),
                "--routing-strategy", "round_robin", "--log-level", "INFO", *flags]  # fmt: skip
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def wait_routed(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _wait_routed(self.channel, 5.0)
                return
            except (grpc.RpcError, TimeoutError):
                if self.process.poll() is not None:
                    raise RuntimeError(f"vllm-serve exited with {self.process.returncode}") from None
        raise TimeoutError("vllm-serve's replicas did not serve")

    def stop(self) -> int:
        self.channel.close()
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)


def start_streams(
    router: RouterProcess | ServeProcess, count: int, max_tokens: int, openai: bool = False
) -> tuple[list[Stream], list[threading.Thread]]:
    stub = pb_grpc.GenerationStub(router.channel)
    streams = [Stream() for _ in range(count)]

    def run(i: int, out: Stream) -> None:
        if openai:
            return run_openai(i, out)
        seeded = i % 2 == 1
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.8 if seeded else 0.0, ignore_eos=True)
        if seeded:
            sampling.seed = i
        request = pb.GenerateRequest(prompt=f"Story {i}: once upon a time", sampling=sampling, model=NAME)
        try:
            for delta in stub.Generate(request, timeout=600):
                if delta.token_ids:
                    out.times.append(time.monotonic())
                    out.tokens += len(delta.token_ids)
        except grpc.RpcError as exc:
            out.error = exc.code().name

    def run_openai(i: int, out: Stream) -> None:
        import openai as client_lib

        client = client_lib.OpenAI(base_url=router.base_url, api_key="none", max_retries=0, timeout=600)
        try:
            prompt, extra = f"Story {i}: once upon a time", {"ignore_eos": True}
            chunks = client.completions.create(
                model=NAME, prompt=prompt, stream=True, max_tokens=max_tokens, extra_body=extra,
                temperature=0.8 if i % 2 else 0.0, seed=i if i % 2 else None, stream_options={"include_usage": True},
            )  # fmt: skip
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].text:
                    out.times.append(time.monotonic())
                    out.tokens += 1  # a chunk a token while it runs (no stop string holds text back here) ...
                if chunk.usage is not None:  # ... and at the end the tokens it had, text or not (a byte of a
                    out.tokens = chunk.usage.completion_tokens  # character: a tiny model's random tokens)
        except client_lib.APIError as exc:
            out.error = type(exc).__name__

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    return streams, threads


def rolling_restart(replica: Cluster, router: RouterProcess, args: argparse.Namespace, migrate: bool) -> dict:
    """Load through the router, then drain and stop `replica` (with or without migration); the streams' fate."""
    streams, threads = start_streams(router, args.streams, args.max_tokens, args.openai)
    deadline = time.monotonic() + 120
    while not all(s.tokens >= 2 or s.error for s in streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    migrated = 0
    if migrate:
        request = pb.DrainRequest(migrate=True)
        migrated = pb_grpc.ControlStub(replica.channel).Drain(request, timeout=60).migrated
    codes = replica.stop(args.grace + 30)  # SIGTERM: it drains for at most --shutdown-timeout (the grace)
    drain_s = time.perf_counter() - start
    for t in threads:
        t.join(600)
    return outcome(streams, args, "drain --migrate, then stop" if migrate else f"stop ({args.grace:g} s grace)",
                   migrated, drain_s, codes)  # fmt: skip


def serve_rolling_restart(serve: ServeProcess, args: argparse.Namespace) -> dict:
    """Load through vllm-serve's router, then SIGHUP: both replicas restarted in turn, their streams migrated."""
    streams, threads = start_streams(serve, args.streams, args.max_tokens, args.openai)
    deadline = time.monotonic() + 120
    while not all(s.tokens >= 2 or s.error for s in streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    serve.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 600
    while "rolling restart done" not in serve.log.read_text() and time.monotonic() < deadline:
        if serve.process.poll() is not None or "rolling restart stopped" in serve.log.read_text():
            raise RuntimeError(f"the rolling restart failed; see {serve.log}")
        time.sleep(0.05)
    round_s = time.perf_counter() - start
    for t in threads:
        t.join(600)
    migrated = sum(int(n) for n in re.findall(r"(\d+) request\(s\) migrated", serve.log.read_text()))
    return outcome(streams, args, "vllm-serve SIGHUP: both replicas in turn", migrated, round_s, [])


def outcome(
    streams: list[Stream], args: argparse.Namespace, mode: str, migrated: int, drain_s: float, codes: list
) -> dict:
    gaps = sorted(s.largest_gap for s in streams if not s.error)
    return {
        "mode": mode,
        "streams": len(streams),
        "completed": sum(not s.error and s.tokens == args.max_tokens for s in streams),
        "cut": sum(bool(s.error) for s in streams),
        "migrated": migrated,
        "largest_gap_s": gaps[-1] if gaps else 0.0,
        "median_largest_gap_s": statistics.median(gaps) if gaps else 0.0,
        "drain_s": drain_s,
        "exit_codes": codes,
    }


def plot(rows: list[dict], path: Path) -> None:
    panels = [
        ([r["cut"] for r in rows], "streams cut"),
        ([r["largest_gap_s"] for r in rows], "largest inter-token gap (s)"),
    ]
    bar_panels(path, [r["mode"] for r in rows], panels)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF folder or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--smoke", action="store_true", help="a small run (CI): 8 streams of 64 tokens, 0.5 s grace")
    p.add_argument("--streams", type=int, default=32, help="streams through the router")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--grace", type=float, default=5.0, help="each replica's --shutdown-timeout (a pod's grace)")
    p.add_argument("--kv-cache-memory", default="", help="each worker's KV cache (a size; '': the worker's default)")
    p.add_argument("--openai", action="store_true", help="OpenAI completions (SSE) through the router, not gRPC")
    p.add_argument("--serve", action="store_true", help="vllm-serve --data-parallel-size 2 and its SIGHUP restart")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="also write bar charts here (PNG, needs matplotlib)")
    args = p.parse_args()
    if args.smoke:  # its own defaults; flags still win
        p.set_defaults(**SMOKE)
        args = p.parse_args()
    from scheduler_node.engine.model_path import resolve_model

    model = resolve_model(args.model)
    flags = ["--served-model-name", NAME, "--shutdown-timeout", str(args.grace)]
    worker = ["--threads", "1"] + (["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else [])
    rows = serve_rows(model, flags + worker, args) if args.serve else pair_rows(model, flags, worker, args)
    report(rows, args)
    return 0


def serve_rows(model: Path, flags: list[str], args: argparse.Namespace) -> list[dict]:
    serve = ServeProcess(model, flags, args.openai)
    try:
        serve.wait_routed()
        row = serve_rolling_restart(serve, args)
        row["exit_codes"] = [serve.stop()]
        return [row]
    finally:
        if serve.process.poll() is None:  # it failed: its children stop with it
            serve.stop()


def pair_rows(model: Path, flags: list[str], worker: list[str], args: argparse.Namespace) -> list[dict]:
    pair = [Cluster(model, flags, worker, http=args.openai) for _ in range(2)]
    http = [f",http=127.0.0.1:{c.http_port}" if args.openai else "" for c in pair]
    router = RouterProcess([f"{c.address},model={NAME}{h}" for c, h in zip(pair, http)], ["--probe-interval", "0.2"],
                           http=args.openai)  # fmt: skip
    rows = []
    try:
        for c in pair:
            c.wait_serving()
        router.wait_serving(60)
        rows.append(rolling_restart(pair[0], router, args, migrate=False))
        old = pair[0]  # the upgraded replica, at the same addresses
        pair[0] = Cluster(model, flags, worker, port=old.port, http=args.openai, http_port=old.http_port)
        pair[0].wait_serving()
        _wait_routed(router.channel)
        rows.append(rolling_restart(pair[0], router, args, migrate=True))
    finally:
        router.stop()
        for c in pair:
            c.kill()
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    kind = "OpenAI (SSE)" if args.openai else "gRPC"
    print(f"{args.streams} {kind} streams of {args.max_tokens} tokens over 2 replicas; load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    what, took = ("vllm-serve's rolling restart", "the round") if args.serve else ("rolling restart of one replica",
                                                                               "drain to exit")  # fmt: skip
    print(f"| {what} | completed | cut | migrated | largest gap (s) | median largest gap (s) | {took} (s) "
          "| exit codes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['completed']}/{r['streams']} | {r['cut']} | {r['migrated']} | "
            f"{r['largest_gap_s']:.3f} | {r['median_largest_gap_s']:.3f} | {r['drain_s']:.2f} | {r['exit_codes']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)


def _wait_routed(channel: grpc.Channel, timeout: float = 30.0) -> None:
    """Until the router serves on both replicas again (its probe found the new one)."""
    control = pb_grpc.ControlStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = control.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas
        if all(r.state == "serving" for r in listed):
            return
        time.sleep(0.05)
    raise TimeoutError("the restarted replica did not rejoin the router")


if __name__ == "__main__":
    sys.exit(main())
