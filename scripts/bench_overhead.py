"""Host cost per step: what the engine and the worker spend around a model that costs nothing (issue 24).

The model's forward pass and LM head are replaced by worker_node/stand_in.py's ZeroCostModel (views of buffers
made once; logits over a `--vocab`-token vocabulary whose argmax is an ordinary word); everything else is real:
`LLM.generate`, the engine loop, the scheduler, the wire, the transport, the worker's `execute`, the sampler, the
detokenizer and the streams. Two paths:

- in-process: `LLM` with its worker on a step thread of this process (the offline API's world of one);
- worker process: `LLM(worker_backend="processes")`, one vllm-worker process over ZeroMQ on loopback (the
  WorkerLink transport, as vllm-serve runs its workers), started from this script so it loads the stand-in.

Each request has a 32-token random prompt and asks for 128 greedy tokens with ignore_eos; the engine keeps LLM's
defaults but for max_num_seqs (the row's sequences) and swap space (none). Figures are per steady decode step
(every request decodes one token; the first `--warmup` such steps are skipped), in thread CPU time, so other
processes on a shared machine do not count (the collector's pauses do):

- engine thread: all of it; schedule() + update(); the wire (encoding and sending plans, decoding results); the
  rest, which is its part of the output path (handing each step to the output thread, the event loop);
- output thread: the output path off the engine's thread (engine/output_thread.py: detokenizer, stop checks,
  deltas, LLM's collectors);
- worker: its step thread (the plan's execute and reply); of it, the input preparation (`StepGather.gather`) and
  the sampler; for the worker process, also the whole process's CPU (its socket thread's wire and any torch threads);
- wall milliseconds per step.

Two last tables time the sampler and the scheduler alone. The sampler's: greedy sampling of 256 rows over the
full 49,152-token vocabulary (wall and process CPU, median of `--sampler-reps`). The stand-in's vocabulary is small
by default because on a CPU the full one makes the argmax (that table) the whole figure; `--vocab 49152` measures
the two together. The scheduler's: `schedule()` and `update()` over steady decodes of each row's sequences, two
plans in flight, results made up (no engine, no other thread; `--scheduler-only` prints only this table).

    .venv/bin/python scripts/bench_overhead.py [--seqs 64,256,1024] [--threads 2] [--repeat 3] [--json out.json]
    .venv/bin/python scripts/bench_overhead.py --smoke                 # seconds; what CI runs
    .venv/bin/python scripts/bench_overhead.py --scheduler-only --repeat 3   # the scheduler alone
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from minivllm.tiny_models import TOKENIZER_FILES  # noqa: E402
from proto.wire import SamplingOptions, StepPlan  # noqa: E402
from worker_node.model_runner import ModelRunner  # noqa: E402
from worker_node.sampler import Sampler  # noqa: E402
from worker_node.stand_in import zero_cost_loader  # noqa: E402
from worker_node.step_inputs import StepGather  # noqa: E402

PATHS = ("in-process", "worker process")
AS_WORKER = "--as-stand-in-worker"  # argv[1] of the worker process this script starts for the second path


# ---- the worker's side: patched into the classes before any runner is built, in whichever process runs it


@dataclass(slots=True)
class WorkerProbe:
    """At each execute: the step thread's CPU, the process's CPU, the time spent so far in `StepGather.gather` and
    in the sampler, and the wall clock, by step id. Differences between two steps' marks give what the steps between
    cost."""

    prepare: float = 0.0
    sample: float = 0.0
    sampling: bool = False  # inside the sampler (sample calls draw: timed once)
    marks: dict[int, tuple[float, float, float, float, float]] = field(default_factory=dict)


WORKER = WorkerProbe()


def install_worker_probe(vocab: int) -> None:
    """The stand-in model in place of the loader's, and the probe's timers around execute, gather, sample."""
    import worker_node.loading

    worker_node.loading.load_model = zero_cost_loader(vocab)  # type: ignore[assignment]
    launch, gather = ModelRunner.launch, StepGather.gather

    def timed_launch(self: ModelRunner, plan: StepPlan) -> Any:  # (execute is launch, then finish)
        w = WORKER
        w.marks[plan.step_id] = (time.thread_time(), time.process_time(), w.prepare, w.sample, time.perf_counter())
        return launch(self, plan)

    def timed_gather(self: StepGather, *args: Any) -> Any:
        start = time.thread_time()
        try:
            return gather(self, *args)
        finally:
            WORKER.prepare += time.thread_time() - start

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        """The sampler's time: `sample`, or `draw` and `logprobs` (the worker's calls; `sample` makes both)."""

        def wrapper(self: Sampler, *args: Any) -> Any:
            if WORKER.sampling:
                return fn(self, *args)
            WORKER.sampling, start = True, time.thread_time()
            try:
                return fn(self, *args)
            finally:
                WORKER.sample += time.thread_time() - start
                WORKER.sampling = False

        return wrapper

    ModelRunner.launch = timed_launch  # type: ignore[method-assign]
    StepGather.gather = timed_gather  # type: ignore[method-assign,assignment]
    Sampler.sample = timed(Sampler.sample)  # type: ignore[method-assign]
    Sampler.draw = timed(Sampler.draw)  # type: ignore[method-assign]
    Sampler.logprobs = timed(Sampler.logprobs)  # type: ignore[method-assign]


def run_as_worker(argv: list[str]) -> int:
    """`bench_overhead.py --as-stand-in-worker REPORT VOCAB <vllm-worker flags>`: vllm-worker with the stand-in
    model; its marks go to REPORT when the scheduler shuts it down."""
    report, vocab, flags = Path(argv[0]), int(argv[1]), argv[2:]
    install_worker_probe(vocab)
    from worker_node.worker import main as worker_main

    code = worker_main(flags)
    report.write_text(json.dumps({str(k): v for k, v in WORKER.marks.items()}))
    return code


# ---- the engine's side


@dataclass(slots=True)
class EngineProbe:
    """Times the engine's calls on one LLM's engine, on its thread only, in that thread's CPU time; marks each
    plan with work at the entry of the schedule() that built it."""

    num_seqs: int
    thread: int = 0  # the engine thread's id (learnt at its first schedule())
    depth: int = 0  # timed calls under way: a call inside another counts once
    totals: dict[str, float] = field(
        default_factory=lambda: {"schedule": 0.0, "update": 0.0, "wire": 0.0, "output_thread": 0.0}
    )
    marks: list[tuple[int, bool, tuple[float, ...]]] = field(default_factory=list)  # (step id, steady, snapshot)

    def snapshot(self) -> tuple[float, ...]:
        t = self.totals
        return (time.thread_time(), time.perf_counter(), t["schedule"], t["update"], t["wire"], t["output_thread"])

    def timed(self, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.depth or threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.totals[what] += time.thread_time() - start

        return wrapper

    def attach(self, llm: Any, transport_modules: list[Any]) -> None:
        engine = llm.engine
        scheduler, workers = engine.scheduler, engine.workers
        schedule = self.timed(scheduler.schedule, "schedule")

        def marked_schedule() -> StepPlan:
            self.thread = threading.get_ident()
            mark = self.snapshot()
            plan: StepPlan = schedule()
            if plan.has_work:  # steady: each of the row's sequences decodes one token (no dict made to see it)
                steady = not plan.new_requests and plan.num_requests == plan.total_tokens == self.num_seqs
                self.marks.append((plan.step_id, steady, mark))
            return plan

        scheduler.schedule = marked_schedule
        processor = engine.outputs.processor
        process = processor.process

        def timed_process(items: Any) -> Any:  # on the output thread (or inline on the engine's)
            start = time.thread_time()
            try:
                return process(items)
            finally:
                if threading.get_ident() != self.thread:
                    self.totals["output_thread"] += time.thread_time() - start

        processor.process = timed_process  # type: ignore[method-assign]
        scheduler.update = self.timed(scheduler.update, "update")
        workers.submit = self.timed(workers.submit, "wire")
        for module in transport_modules:  # the results' decoding (the plans' is inside submit)
            module.decode = self.timed(module.decode, "wire")


def steady_window(marks: list[tuple[int, bool, tuple[float, ...]]], warmup: int, steps: int) -> list[Any]:
    """The marks of the longest run of consecutive steady plans, less its first `warmup`, at most `steps` + 1."""
    best: list[Any] = []
    run: list[Any] = []
    for mark in marks:
        run = run + [mark] if mark[1] else []
        if len(run) > len(best):
            best = run
    window = best[warmup : warmup + steps + 1]
    if len(window) < 2:
        raise RuntimeError(f"only {len(best)} steady decode steps, {warmup} of them warm-up: raise --output-tokens")
    return window


# ---- one run


def stand_in_folder(source: Path, into: Path) -> Path:
    """A model folder the stand-in loads: `source`'s tokenizer and config, one layer with one KV head (its KV
    cache is allocated, never read), and a one-tensor checkpoint for the scheduler's checks."""
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    heads = {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1}
    config |= heads | {"head_dim": 64, "max_position_embeddings": 4096}
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, into / name)
    save_file({"stand_in": torch.zeros(1)}, str(into / "model.safetensors"))
    return into


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab) for _ in range(length)] for _ in range(count)]


def measure(path: str, num_seqs: int, folder: Path, args: argparse.Namespace, scratch: Path) -> dict:
    """One LLM, one generate of `num_seqs` requests; the figures of its steady decode steps."""
    import minivllm.llm
    import scheduler_node.engine.worker_link
    import worker_node.inprocess
    from minivllm import LLM, SamplingParams
    from scheduler_node.engine.launchers import LocalLauncher

    report = scratch / f"worker-{os.getpid()}-{time.monotonic_ns()}.json"

    class StandInLauncher(LocalLauncher):
        """vllm-worker's flags, but this script's stand-in worker in place of `-m worker_node.worker`."""

        def _spawn(self) -> Any:
            if self.argv[1:3] == ["-m", "worker_node.worker"]:
                script = [sys.executable, str(Path(__file__).resolve()), AS_WORKER, str(report), str(args.vocab)]
                self.argv = script + self.argv[3:] + ["--log-level", "WARNING"]
            return super()._spawn()

    minivllm.llm.LocalLauncher = StandInLauncher  # type: ignore[misc]
    WORKER.marks.clear()
    blocks_per_seq = -(-(args.prompt_tokens + args.output_tokens) // 16) + 1
    backend = "inprocess" if path == "in-process" else "processes"
    llm = LLM(
        str(folder),
        max_num_seqs=num_seqs,
        num_kv_blocks=num_seqs * blocks_per_seq + 64,
        kv_cache_memory="8GiB",
        swap_space=0.0,
        threads=args.threads,
        worker_backend=backend,
        overlap_steps=args.overlap_steps,
    )
    probe = EngineProbe(num_seqs)
    try:
        probe.attach(llm, [scheduler_node.engine.worker_link, worker_node.inprocess])
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts(num_seqs, args.prompt_tokens, 40000, num_seqs), params, use_tqdm=False)
    finally:
        llm.close()
    if any(len(o.outputs[0].token_ids) != args.output_tokens for o in outs):
        raise RuntimeError("a request did not generate all its tokens")
    worker_marks = WORKER.marks
    if path == "worker process":
        worker_marks = {int(k): tuple(v) for k, v in json.loads(report.read_text()).items()}  # type: ignore[misc]
        report.unlink()
    return figures(path, num_seqs, steady_window(probe.marks, args.warmup, args.steps), worker_marks)


def figures(path: str, num_seqs: int, window: list[Any], worker_marks: dict[int, Any]) -> dict:
    (first_id, _, e0), (last_id, _, e1) = window[0], window[-1]
    n = len(window) - 1
    cpu, wall, schedule, update, wire, output_thread = ((b - a) * 1e3 / n for a, b in zip(e0, e1))
    w0, w1 = worker_marks[first_id], worker_marks[last_id]
    step_thread, process, prepare, sample, _ = ((b - a) * 1e3 / n for a, b in zip(w0, w1))
    row = {
        "path": path,
        "seqs": num_seqs,
        "steps": n,
        "engine_ms": cpu,
        "schedule_update_ms": schedule + update,
        "wire_ms": wire,
        "output_ms": cpu - schedule - update - wire,
        "output_thread_ms": output_thread,
        "worker_ms": step_thread,
        "prepare_ms": prepare,
        "sampler_ms": sample,
        "worker_other_ms": step_thread - prepare - sample,
        "wall_ms": wall,
    }
    if path == "worker process":
        row["worker_process_ms"] = process
    return row


# ---- the sampler alone


@dataclass(slots=True)
class _Row:
    handle: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingOptions


def measure_sampler(rows: int, vocab: int, reps: int) -> dict:
    """Greedy sampling of `rows` rows of `vocab` logits: median wall and process CPU of `reps` calls."""
    sampler = Sampler(vocab, torch.device("cpu"))
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    requests = [_Row(i, list(range(40)), 32, SamplingOptions(temperature=0.0)) for i in range(rows)]
    expected = logits.argmax(dim=-1).tolist()
    walls, cpus = [], []
    for i in range(reps + 2):  # two warm-up calls
        wall, cpu = time.perf_counter(), time.process_time()
        tokens, _ = sampler.sample(logits, requests)
        if i >= 2:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        if tokens != expected:
            raise RuntimeError("greedy sampling is not the argmax of the logits")
    wall, cpu = statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3
    return {"rows": rows, "vocab": vocab, "wall_ms": wall, "cpu_ms": cpu}


# ---- the scheduler alone


def measure_scheduler(num_seqs: int, steps: int, reps: int) -> dict:
    """`schedule()` and `update()` alone over `num_seqs` steady decodes with two plans in flight (async scheduling,
    as the engine runs them) and made-up results: thread CPU ms of each per step, the median of the steps after
    the first 20, the best of `reps` runs (what the scheduler costs, without the other threads' noise)."""
    from proto.wire import ExecutionMode, StepResult, pack_int32
    from scheduler_node.core.config import SchedulerConfig
    from scheduler_node.core.request import Request, StopConditions
    from scheduler_node.core.scheduler import Scheduler

    best = [float("inf"), float("inf")]
    for _ in range(reps):
        config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs * 33))
        s = Scheduler(config, num_seqs * (steps // 16 + 4), mode=ExecutionMode.for_world(1, 1, True))
        for i, prompt in enumerate(prompts(num_seqs, 32, 40000, num_seqs)):
            s.add(Request(f"r{i}", prompt, SamplingOptions(temperature=0.0), StopConditions(steps + 64)))
        times: list[list[float]] = [[], []]
        in_flight: list[StepPlan] = []
        for _ in range(steps + 20):
            start = time.thread_time()
            in_flight.append(s.schedule())
            times[0].append(time.thread_time() - start)
            if len(in_flight) == 2:
                plan = in_flight.pop(0)
                handles = list(plan.num_scheduled_tokens)  # one token each, packed as the workers send them
                tokens = [300 + (h + plan.step_id) % 997 for h in handles]
                result = StepResult(plan.step_id, {}, token_handles=pack_int32(handles), tokens=pack_int32(tokens))
                start = time.thread_time()
                s.update(plan, result)
                times[1].append(time.thread_time() - start)
        best = [min(b, statistics.median(t[20:]) * 1e3) for b, t in zip(best, times)]
    return {"seqs": num_seqs, "schedule_ms": best[0], "update_ms": best[1]}


# ---- the report


COLUMNS = (  # (header, key)
    ("engine thread", "engine_ms"),
    ("schedule+update", "schedule_update_ms"),
    ("wire", "wire_ms"),
    ("output path", "output_ms"),
    ("output thread", "output_thread_ms"),
    ("worker step thread", "worker_ms"),
    ("prepare", "prepare_ms"),
    ("sampler", "sampler_ms"),
    ("other", "worker_other_ms"),
    ("worker process", "worker_process_ms"),
    ("wall / step", "wall_ms"),
)


def median_row(runs: list[dict]) -> dict:
    """Each figure's median over the runs of one row."""
    row = dict(runs[0]) | {"runs": len(runs)}
    for key in runs[0]:
        if key.endswith("_ms"):
            row[key] = statistics.median(r[key] for r in runs)
    return row


def _print_rows(report: dict) -> None:
    print(f"\n## host cost per steady decode step, ms of thread CPU ({report['threads_label']}, load {report['load']})")
    print("| path | seqs | steps | " + " | ".join(h for h, _ in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for r in report["rows"]:
        cells = [f"{r[k]:.2f}" if k in r else "-" for _, k in COLUMNS]
        print(f"| {r['path']} | {r['seqs']} | {r['steps']} | " + " | ".join(cells) + " |")


def print_tables(report: dict) -> None:
    if report["rows"]:
        _print_rows(report)
    s = report["sampler"]
    if s:
        print("\n| sampler | rows | vocab | wall ms | process CPU ms |\n|---|---|---|---|---|")
        print(f"| greedy | {s['rows']} | {s['vocab']} | {s['wall_ms']:.2f} | {s['cpu_ms']:.2f} |")
    print("\n| scheduler alone | seqs | schedule() ms | update() ms | µs per sequence |\n|---|---|---|---|---|")
    for r in report["scheduler"]:
        per_seq = (r["schedule_ms"] + r["update_ms"]) * 1e3 / r["seqs"]
        print(f"| steady decodes | {r['seqs']} | {r['schedule_ms']:.3f} | {r['update_ms']:.3f} | {per_seq:.2f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="the model whose tokenizer and config the stand-in takes")
    p.add_argument("--seqs", default="64,256,1024", help="running sequences per row, comma-separated")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of: " + ", ".join(PATHS))
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each random prompt")
    p.add_argument("--output-tokens", type=int, default=128, help="greedy tokens each request generates")
    p.add_argument("--vocab", type=int, default=1024, help="the stand-in model's vocabulary (its logits' width)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the worker and this process (0: torch's)")
    p.add_argument("--warmup", type=int, default=10, help="steady decode steps skipped before measuring")
    p.add_argument("--steps", type=int, default=80, help="steady decode steps measured, at most")
    p.add_argument("--repeat", type=int, default=1, help="runs of every row, round robin; each figure's median")
    p.add_argument("--sampler-rows", type=int, default=256, help="rows of the sampler table")
    p.add_argument("--sampler-vocab", type=int, default=49152, help="vocabulary of the sampler table")
    p.add_argument("--sampler-reps", type=int, default=20, help="timed calls of the sampler table")
    p.add_argument(
        "--overlap-steps",
        choices=("auto", "on", "off"),
        default="auto",
        help="the worker's --overlap-steps (auto: off on a CPU); on measures the host cost of the path a GPU takes",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--scheduler-only", action="store_true", help="only the scheduler-alone table (no engine)")
    p.add_argument("--smoke", action="store_true", help="8 sequences of 24 tokens, both paths (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqs, args.output_tokens, args.warmup, args.steps = "8", 24, 2, 10
        args.sampler_rows, args.sampler_reps = 16, 3
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown:
        p.error(f"--paths: unknown {sorted(unknown)}; choose from {PATHS}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [AS_WORKER]:
        return run_as_worker(argv[1:])
    args = parse_args(argv)
    from scheduler_node.engine.model_path import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    install_worker_probe(args.vocab)  # the in-process path's worker runs here
    cells = (
        [] if args.scheduler_only else [(path, int(n)) for n in args.seqs.split(",") for path in args.paths.split(",")]
    )
    runs: dict[tuple[str, int], list[dict]] = {cell: [] for cell in cells}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as scratch:
        folder = stand_in_folder(resolve_model(args.model), Path(scratch) / "stand-in") if cells else Path(scratch)
        for _ in range(args.repeat):  # round robin: a noisy minute on a shared machine hits one run of each row
            for path, num_seqs in cells:
                runs[path, num_seqs].append(measure(path, num_seqs, folder, args, Path(scratch)))
                print(json.dumps(runs[path, num_seqs][-1]), file=sys.stderr, flush=True)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "threads_label": f"{args.threads} torch threads" if args.threads else "torch's default threads",
        "load": f"{load:.1f} before, {os.getloadavg()[0]:.1f} after",
        "vocab": args.vocab,
        "overlap_steps": args.overlap_steps,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "rows": [median_row(runs[cell]) for cell in cells],
        "sampler": {}
        if args.scheduler_only
        else measure_sampler(args.sampler_rows, args.sampler_vocab, args.sampler_reps),
        "scheduler": [measure_scheduler(int(n), args.steps, args.repeat + 2) for n in args.seqs.split(",")],
    }
    print_tables(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
