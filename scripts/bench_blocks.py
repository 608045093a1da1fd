"""What the KV block size costs (issue 50, "design from measurement first"): four measures at each block size.

(a) attention: the native CPU decode kernel (kernels/cpu_attention.py) at SmolLM2-135M's shape (9 query heads, 3
    KV heads, head dim 64), one call per layer over a pool of scattered blocks, for 1 and several sequences at each
    context, bf16 and fp32 caches, at each thread count: the median of repeats (three rounds over the block sizes
    in turn), in wall time and process CPU time.
    A timed sample is one call on each of up to 30 layer caches in turn (as a step walks the layers; enough of them
    that the caches do not all sit in the last-level cache), divided by the layers. The kernel is built for blocks
    of at most 64 tokens: larger ones fall back to the torch path and are not timed. Correctness first: the kernel
    and, under `TRITON_INTERPRET=1`, the Triton decode kernel against the torch reference at every block size
    (never timed).
(b) host cost: the real Scheduler over stand-in workers (scheduler_node/engine/stand_in.py, answering as workers
    do; two plans in flight, as the engine runs them) with N sequences decoding at each context: thread CPU of
    schedule() + encode(plan) + update() per steady decode step (the mean, since the steps where sequences start
    a block cost more), the plan's encoded bytes per step, and the prefill's cost per 1,000 prompt tokens (blocks
    claimed, prefix hashes, the plans' block ids); beside them the worker's copy of the batch's block tables.
(c) tail waste: a mixed workload (short chats, and 2k-8k-token generations) through the same Scheduler in a pool of
    1 GiB of SmolLM2-135M's bf16 KV: at each step the pool is full (requests waiting, usage >= 97 %), the slots
    allocated against the tokens stored; KV tokens stored per GiB.
(d) prefix hits: a 1,000-token shared system prompt with varied user turns (the requests after the first), and
    multi-turn chats that resend their history: prompt tokens found cached / prompt tokens (only full blocks are
    cached, and a prompt's last token is always computed).

    .venv/bin/python scripts/bench_blocks.py [--threads 2,1] [--json out.json]
    .venv/bin/python scripts/bench_blocks.py --smoke        # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's kernels on CPU, for correctness: before any import of it

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kernels import torch_attention as ref  # noqa: E402
from kernels.backend import triton_available  # noqa: E402
from kernels.cpu_attention import NativeDecodeAttention, plan_decode  # noqa: E402
from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult, encode  # noqa: E402
from scheduler_node.core.config import SchedulerConfig  # noqa: E402
from scheduler_node.core.request import Request, StopConditions  # noqa: E402
from scheduler_node.core.scheduler import Scheduler  # noqa: E402
from scheduler_node.core.stats import tokens_stored  # noqa: E402
from scheduler_node.engine.stand_in import StandInWorkers  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # K and V of every layer, bf16
NATIVE_MAX_BLOCK = 64  # kernels/csrc/paged_attention_cpu.c's MAX_BLOCK_SIZE
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYER_ROTATION_BYTES = 128 << 20  # caches walked per sample: 4 x this machine's 32 MiB L3, at most 30 layers
GREEDY = SamplingOptions(temperature=0.0)
UNIT = 16  # the unit of the scheme the runs measure: 16-token blocks, adjacent in runs
PARTS = ("attention", "scheduler", "waste", "prefix")  # (a) to (d)
ROUNDS = 3  # attention: each block size timed in turn, this many times


# ---- (a) attention


def correctness(block_sizes: list[int]) -> list[dict]:
    """The native kernel (blocks up to 64) and Triton's decode kernel in its interpreter against the torch
    reference, fp32, lengths that end mid-block and on a block's end."""
    rows = []
    tri: ModuleType | None = None
    if triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
        tri = importlib.import_module("kernels.triton_attention")
    native = NativeDecodeAttention(ref.paged_decode_attention)
    for bs in block_sizes:
        lens = [1, bs, bs + 1, 3 * bs + 5]
        k, v, tables = _pool(len(lens), max(lens), bs, torch.float32, torch.Generator().manual_seed(bs))
        q = torch.randn(len(lens), HEADS, HEAD_DIM)
        args = (q, k, v, tables, torch.tensor(lens, dtype=torch.int32), HEAD_DIM**-0.5)
        want = ref.paged_decode_attention(*args)
        got = {"native": native(*args) if bs <= NATIVE_MAX_BLOCK else None}
        got["triton (interpreter)"] = tri.paged_decode_attention(*args) if tri is not None else None
        for kernel, out in got.items():
            err = None if out is None else float((out - want).norm() / want.norm())
            rows.append({"kernel": kernel, "block_size": bs, "rel_err": err, "ok": err is None or err < 1e-5})
    return rows


def _pool(
    seqs: int, context: int, bs: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches holding `seqs` sequences of `context` tokens in blocks scattered over the pool, and their
    block tables."""
    per_seq = -(-context // bs)
    k = torch.randn(seqs * per_seq, bs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(seqs * per_seq, bs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return k, v, torch.randperm(seqs * per_seq, generator=gen, dtype=torch.int32).view(seqs, per_seq)


def time_attention(
    seqs: int,
    context: int,
    block_sizes: list[int],
    dtype: torch.dtype,
    threads: list[int],
    min_s: float,
    unit_runs: int = 0,
) -> list[dict]:
    """Per layer call: wall and process CPU µs (medians) of the native kernel at each block size and thread count,
    and (`unit_runs` > 1) at 16-token blocks placed in runs of that many adjacent ones. One pool of caches per
    (seqs, context, dtype), viewed at each block size (the same bytes, cut differently)."""
    padded = -(-context // 128) * 128
    layer_bytes = 2 * seqs * padded * KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8
    layers = max(1, min(LAYERS, -(-LAYER_ROTATION_BYTES // layer_bytes)))
    gen = torch.Generator().manual_seed(context + seqs)
    flat = [torch.randn(2, seqs * padded, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(layers)]
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    kernel = NativeDecodeAttention(ref.paged_decode_attention)
    rows, steps = [], {}
    layouts = [(bs, 1) for bs in block_sizes] + ([(UNIT, unit_runs)] if unit_runs > 1 else [])
    for bs, run in layouts:
        row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "seqs": seqs, "context": context}
        timed = bs <= NATIVE_MAX_BLOCK
        rows.append(row | {"block_size": bs, "run": run, "layers": layers, "timed": timed})
        if timed:
            caches = [(f[0].view(-1, bs, KV_HEADS, HEAD_DIM), f[1].view(-1, bs, KV_HEADS, HEAD_DIM)) for f in flat]
            steps[bs, run] = _one_call_per_layer(kernel, q, caches, _tables(seqs, padded // bs, run, gen), seq_lens)
    samples: dict[tuple[int, int, int], list[tuple[float, float]]] = {
        (*layout, t): [] for layout in steps for t in threads
    }
    for _ in range(ROUNDS):  # round robin: a noisy moment on a shared machine hits one round of each block size
        for (bs, run, t), taken in samples.items():
            torch.set_num_threads(t)
            taken += _repeat(steps[bs, run], min_s / ROUNDS)
    for row in rows:
        for t in threads:
            got = samples.get((row["block_size"], row["run"], t))
            if got:
                row[f"wall_us_{t}t"] = statistics.median(w for w, _ in got) / layers * 1e6
                row[f"cpu_us_{t}t"] = statistics.median(c for _, c in got) / layers * 1e6
    return rows


def _tables(seqs: int, per_seq: int, run: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables over a pool of `seqs * per_seq` blocks: scattered one by one (`run` 1), or in runs of `run`
    adjacent blocks, each run at a random place (a run of 16-token units, listed unit by unit)."""
    starts = torch.randperm(seqs * per_seq // run, generator=gen, dtype=torch.int32) * run
    return (starts[:, None] + torch.arange(run, dtype=torch.int32)).reshape(seqs, per_seq)


def _one_call_per_layer(
    kernel: NativeDecodeAttention,
    q: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> Callable[[], None]:
    """A step's decode attention: the tables converted once (the backend's plan_decode), then a call per layer."""
    plan = plan_decode(tables, seq_lens, caches[0][0].shape[1])

    def step() -> None:
        for k, v in caches:
            kernel(q, k, v, tables, seq_lens, HEAD_DIM**-0.5, plan=plan)

    return step


def _repeat(fn: Callable[[], None], min_s: float) -> list[tuple[float, float]]:
    """Wall and process CPU seconds of `fn` over at least 2 samples and `min_s` seconds (after one warm-up)."""
    fn()
    taken: list[tuple[float, float]] = []
    start = time.perf_counter()
    while len(taken) < 2 or time.perf_counter() - start < min_s:
        w, c = time.perf_counter(), time.process_time()
        fn()
        taken.append((time.perf_counter() - w, time.process_time() - c))
    return taken


# ---- (b) the scheduler


class Driver:
    """A Scheduler and stand-in workers stepped as the engine steps them: each plan is run as it is sent, its
    result applied once the next plan is made (two in flight with async scheduling)."""

    def __init__(self, bs: int, num_blocks: int, max_seqs: int, max_len: int, in_flight: int = 2) -> None:
        config = SchedulerConfig(
            block_size=bs, max_num_batched_tokens=16384, max_num_seqs=max_seqs, max_model_len=max_len
        )
        self.scheduler = Scheduler(config, num_blocks, mode=ExecutionMode.for_world(1, 1, in_flight > 1))
        self.workers = StandInWorkers(num_blocks, token=300, block_size=bs)
        self.in_flight: list[tuple[StepPlan, StepResult]] = []
        self.depth = in_flight

    def step(self) -> tuple[StepPlan, float, int]:
        """One schedule(), encode and, for the oldest plan in flight, update(): the plan, their thread CPU seconds
        (the stand-in workers' part left out) and the encoded plan's bytes."""
        start = time.thread_time()
        plan = self.scheduler.schedule()
        size = len(encode(plan))
        scheduled = time.thread_time()
        self.in_flight.append((plan, self.workers.execute(plan)))
        executed = time.thread_time()
        if len(self.in_flight) >= self.depth:
            self.scheduler.update(*self.in_flight.pop(0))
        return plan, scheduled - start + time.thread_time() - executed, size

    def drain(self) -> None:
        while self.in_flight:
            self.scheduler.update(*self.in_flight.pop(0))


def measure_scheduler(bs: int, context: int, seqs: int, steps: int) -> dict:
    """`seqs` sequences whose prompts end within 128 tokens past `context` (so their block starts are spread),
    prefilled, then `steps` steady decode steps after 8 of warm-up."""
    rng = random.Random(context)
    lens = [context + rng.randrange(128) for _ in range(seqs)]
    max_len = max(lens) + steps + 64
    d = Driver(bs, seqs * -(-max_len // bs) + 64, seqs, max_len)
    for i, n in enumerate(lens):
        d.scheduler.add(Request(f"r{i}", [rng.randrange(100, 40000) for _ in range(n)], GREEDY, StopConditions(4096)))
    prefill_s = prefill_bytes = 0.0
    while True:
        plan, cpu, size = d.step()
        prefill_s, prefill_bytes = prefill_s + cpu, prefill_bytes + size
        if plan.total_tokens == seqs and len(plan.num_scheduled_tokens) == seqs:  # every sequence decodes
            break
    decode = [d.step() for _ in range(8 + steps)][8:]
    d.drain()
    cpus = [cpu for _, cpu, _ in decode]
    return worker_tables(seqs, max(lens), bs) | {
        "block_size": bs,
        "context": context,
        "seqs": seqs,
        "decode_ms_per_step": statistics.mean(cpus) * 1e3,
        "decode_p99_ms": sorted(cpus)[int(0.99 * (len(cpus) - 1))] * 1e3,
        "plan_bytes_per_step": statistics.mean(size for _, _, size in decode),
        "prefill_ms_per_1k_tokens": prefill_s * 1e3 / (sum(lens) / 1000),
        "prefill_plan_bytes_per_1k_tokens": prefill_bytes / (sum(lens) / 1000),
    }


def worker_tables(seqs: int, context: int, bs: int) -> dict:
    """The worker's share of a step's block tables: worker_node/step_inputs.py copies its batch's rows of the
    block-table array (`block_table[rows, :width]`, int32) every step; the same numpy copy, timed alone (median
    thread CPU µs of 200; a sequence's table is context / block size entries wide)."""
    width = -(-context // bs)
    table = np.zeros((2 * seqs, width + 16), dtype=np.int32)
    rows = np.arange(0, 2 * seqs, 2)
    times = []
    for _ in range(200):
        start = time.thread_time_ns()
        np.ascontiguousarray(table[rows, :width])
        times.append(time.thread_time_ns() - start)
    return {"worker_table_us": statistics.median(times) / 1e3, "table_entries": seqs * width}


# ---- (c) tail waste


def mixed_request(rng: random.Random, i: int, long_share: float, max_len: int) -> Request:
    """A short chat (30-300 prompt tokens, 20-400 out) or a long generation (100-1000 in, 2k-8k out; at most
    `max_len` in all, for a smoke run's small pool)."""
    if rng.random() < long_share:
        prompt = rng.randrange(100, 1000)
        out = min(rng.randrange(2048, 8192), max_len - prompt)
    else:
        prompt, out = rng.randrange(30, 300), rng.randrange(20, 400)
    return Request(f"m{i}", [rng.randrange(100, 40000) for _ in range(prompt)], GREEDY, StopConditions(out))


def measure_waste(bs: int, pool_tokens: int, snapshots: int, long_share: float) -> dict:
    """The mixed workload in a pool of `pool_tokens` slots, 8 requests kept waiting: at each of `snapshots` steps
    when the pool is full, the slots of the blocks in use, the tokens stored in them and the sequences holding
    them."""
    rng = random.Random(50)
    max_len = min(16384, pool_tokens // 2)
    d = Driver(bs, pool_tokens // bs, 128, max_len)
    s = d.scheduler
    allocated = stored = holders = taken = steps = added = 0
    while taken < snapshots:
        while len(s.queues.waiting) < 8:
            s.add(mixed_request(rng, added, long_share, max_len))
            added += 1
        d.step()
        steps += 1
        if s.blocks.usage >= 0.97:
            allocated += s.blocks.num_used * bs
            stored += tokens_stored(s)
            holders += sum(1 for r in s.requests.values() if s.blocks.blocks_of(r.req_id))
            taken += 1
        if steps > 200_000:
            raise RuntimeError(f"block size {bs}: the pool was full at only {taken} of {steps} steps")
    d.drain()
    return {
        "block_size": bs,
        "pool_tokens": pool_tokens // bs * bs,
        "snapshots": taken,
        "seqs_at_full": holders / taken,  # sequences holding blocks, the mean over the snapshots
        "stored_share": stored / allocated,
        "wasted_per_seq": (allocated - stored) / holders,
        "tokens_per_gib": (1 << 30) / KV_BYTES_PER_TOKEN * stored / allocated,
        "preemptions": s.num_preemptions,
    }


# ---- (d) prefix hits


def run_to_end(d: Driver, req: Request) -> list[int]:
    """Add one request and step until it finishes; its output tokens."""
    d.scheduler.add(req)
    while d.scheduler.num_unfinished:
        d.step()
    d.drain()
    return req.output_token_ids


def measure_prefix(bs: int, users: int, chats: int, turns: int) -> dict:
    """Hit tokens / prompt tokens: `users` requests sharing a 1,000-token system prompt (each its own 20-300-token
    turn, 8 tokens out), then `chats` conversations of `turns` turns, each resending its history."""
    rng = random.Random(7)
    pool = 64 * 1024
    rates = {}
    system = [rng.randrange(100, 40000) for _ in range(1000)]
    d = Driver(bs, pool // bs, 8, 16384, in_flight=1)
    c = d.scheduler.counters
    for i in range(users):
        if i == 1:  # the first request fills the cache: the rate is the later ones'
            c.prefix_cache_hits = c.prefix_cache_queries = 0
        turn = [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 300))]
        run_to_end(d, Request(f"u{i}", system + turn, GREEDY, StopConditions(8)))
    rates["shared_system_prompt"] = c.prefix_cache_hits / c.prefix_cache_queries
    d = Driver(bs, pool // bs, 8, 16384, in_flight=1)
    for chat in range(chats):
        history = system[: rng.randrange(50, 400)]
        for i in range(turns):
            history = history + [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 200))]
            req = Request(f"c{chat}.{i}", history, GREEDY, StopConditions(rng.randrange(30, 300)))
            history = history + run_to_end(d, req)
    c = d.scheduler.counters
    rates["multi_turn_chat"] = c.prefix_cache_hits / c.prefix_cache_queries
    return {"block_size": bs} | rates


# ---- the report


def machine() -> dict:
    """What ran it: the date, the CPU and its flags of note, the load."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "cpu": f"{model}, {os.cpu_count()} cores ({platform.machine()})",
        "flags": [f for f in wanted if f in flags],
        "loadavg_before": _loadavg(),
    }


def _loadavg() -> str:
    path = Path("/proc/loadavg")
    return path.read_text().strip() if path.exists() else "?"


def _table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n## {title}\n| " + " | ".join(h for h, _, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        cells = [format(r[k], f) if r.get(k) is not None else "-" for _, k, f in columns]
        print("| " + " | ".join(cells) + " |")


CHECKS = [("kernel", "kernel", ""), ("block", "block_size", "d"), ("rel err", "rel_err", ".1e"), ("ok", "ok", "")]
SCHEDULER = [
    ("context", "context", "d"),
    ("block", "block_size", "d"),
    ("ms/step", "decode_ms_per_step", ".3f"),
    ("p99 ms", "decode_p99_ms", ".3f"),
    ("plan B/step", "plan_bytes_per_step", ".0f"),
    ("prefill ms/1k tok", "prefill_ms_per_1k_tokens", ".2f"),
    ("prefill plan B/1k tok", "prefill_plan_bytes_per_1k_tokens", ".0f"),
    ("table entries", "table_entries", "d"),
    ("worker table µs", "worker_table_us", ".1f"),
]
WASTE = [
    ("block", "block_size", "d"),
    ("seqs holding blocks", "seqs_at_full", ".1f"),
    ("stored/allocated", "stored_share", ".3f"),
    ("wasted slots/seq", "wasted_per_seq", ".1f"),
    ("tokens/GiB", "tokens_per_gib", ".0f"),
    ("preemptions", "preemptions", "d"),
]
PREFIX = [
    ("block", "block_size", "d"),
    ("1,000-token system prompt", "shared_system_prompt", ".3f"),
    ("multi-turn chat", "multi_turn_chat", ".3f"),
]


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"# block sizes: {m['date']}, {m['cpu']}")
    print(f"flags {' '.join(m['flags'])}; threads {report['threads']}; a shared machine: /proc/loadavg")
    print(f"{m['loadavg_before']} before, {report['loadavg_after']} after")
    _table("correctness vs the torch reference (fp32)", report["correctness"], CHECKS)
    columns = [("dtype", "dtype", ""), ("seqs", "seqs", "d"), ("context", "context", "d"), ("block", "block_size", "d")]
    columns += [("run", "run", "d")]
    for t in report["threads"]:
        columns += [(f"wall µs {t}t", f"wall_us_{t}t", ".1f"), (f"CPU µs {t}t", f"cpu_us_{t}t", ".1f")]
    title = "(a) native decode attention per layer call (median; x30 layers per SmolLM2 step)"
    _table(title, report["attention"], columns)
    title = f"(b) host cost per step, {report['sched_seqs']} sequences decoding (thread CPU)"
    _table(title, report["scheduler"], SCHEDULER)
    title = "(c) tail waste when the pool is full (mixed chats and 2k-8k generations, 1 GiB of bf16 KV)"
    _table(title, report["waste"], WASTE)
    _table("(d) prefix hit rate (hit tokens / prompt tokens)", report["prefix"], PREFIX)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-sizes", default="8,16,32,64,128", help="comma-separated block sizes")
    p.add_argument("--contexts", default="512,2048,8192,32768", help="comma-separated context lengths (tokens)")
    p.add_argument("--attention-seqs", default="1,8", help="sequences per attention call, comma-separated")
    p.add_argument("--dtypes", default="bf16,fp32", help="KV cache dtypes of the attention table: bf16, fp32")
    p.add_argument("--threads", default="2,1", help="torch (OpenMP) threads of the attention table, comma-separated")
    p.add_argument("--min-seconds", type=float, default=0.3, help="least time spent timing each attention cell")
    p.add_argument("--sched-seqs", type=int, default=32, help="sequences decoding in the scheduler table")
    p.add_argument("--sched-steps", type=int, default=256, help="steady decode steps timed per scheduler cell")
    p.add_argument("--pool-tokens", type=int, default=(1 << 30) // KV_BYTES_PER_TOKEN, help="(c)'s pool, tokens")
    p.add_argument("--snapshots", type=int, default=400, help="(c): full-pool steps sampled")
    p.add_argument("--long-share", type=float, default=0.3, help="(c): share of 2k-8k-token generations")
    p.add_argument(
        "--unit-runs", type=int, default=4, help="(a): also 16-token blocks in runs of this many adjacent ones (0: not)"
    )
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts, args.attention_seqs, args.threads, args.min_seconds = "64,300", "1,2", "1", 0.0
        args.sched_seqs, args.sched_steps, args.pool_tokens, args.snapshots = 4, 16, 4096, 20
    for flag in ("block_sizes", "contexts", "attention_seqs", "threads"):
        try:
            setattr(args, flag, [int(x) for x in getattr(args, flag).split(",")])
        except ValueError:
            p.error(f"--{flag.replace('_', '-')}: comma-separated integers, got {getattr(args, flag)!r}")
    bad = [b for b in args.block_sizes if b not in (8, 16, 32, 64, 128)]
    if bad:
        p.error(f"--block-sizes: each one of 8, 16, 32, 64, 128, got {bad}")
    args.parts = args.parts.split(",")
    if set(args.parts) - set(PARTS):
        p.error(f"--parts: of {PARTS}, got {args.parts}")
    if args.unit_runs not in (0, 1, 2, 4, 8):
        p.error(f"--unit-runs: one of 0, 1, 2, 4, 8, got {args.unit_runs}")
    args.dtypes = args.dtypes.split(",")
    if set(args.dtypes) - set(DTYPES):
        p.error(f"--dtypes: of {sorted(DTYPES)}, got {args.dtypes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"machine": machine(), "threads": args.threads, "sched_seqs": args.sched_seqs}
    report["correctness"] = correctness(args.block_sizes)
    report["attention"] = (
        [
            row
            for dtype in args.dtypes
            for seqs in args.attention_seqs
            for ctx in args.contexts
            for row in time_attention(
                seqs, ctx, args.block_sizes, DTYPES[dtype], args.threads, args.min_seconds, args.unit_runs
            )
        ]
        if "attention" in args.parts
        else []
    )
    sizes = args.block_sizes
    report["scheduler"] = (
        [measure_scheduler(bs, ctx, args.sched_seqs, args.sched_steps) for ctx in args.contexts for bs in sizes]
        if "scheduler" in args.parts
        else []
    )
    report["waste"] = (
        [measure_waste(bs, args.pool_tokens, args.snapshots, args.long_share) for bs in sizes]
        if "waste" in args.parts
        else []
    )
    chats = (2, 2, 3) if args.smoke else (32, 16, 4)
    report["prefix"] = [measure_prefix(bs, *chats) for bs in sizes] if "prefix" in args.parts else []
    report["loadavg_after"] = _loadavg()
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
