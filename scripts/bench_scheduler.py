"""The scheduler at scale: the real EngineCore and Scheduler over stand-in workers (no model, seconds to run).

The engine runs as a server runs it (async scheduling, prefix caching on, block size 16, one stream reader per
request) over `StandInWorkers`, which answer one token per sampling request. A probe times the engine's own calls
on these instances, without changing them: `Scheduler.schedule`, `encode(plan)` (as the ZeroMQ link encodes it),
`Scheduler.update`, and the engine's output path (from the end of `update` to the next `schedule`: detokenizer,
stop strings, metrics, stream queues), in the thread's CPU time (other processes on a shared machine do not count;
the collector's pauses do). Steps count once every running request decodes; each row gives the means over
`--steps` of them, the p99 of the scheduler's sum, and the plan's bytes per decoding request. A last table times
the admission of 256 new requests at once.

    .venv/bin/python scripts/bench_scheduler.py [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult, decode, encode  # noqa: E402
from scheduler_node.core.config import SchedulerConfig  # noqa: E402
from scheduler_node.core.policy import make_policy  # noqa: E402
from scheduler_node.core.request import RequestSpec  # noqa: E402
from scheduler_node.core.scheduler import RequestOutput, Scheduler  # noqa: E402
from scheduler_node.engine.core import EngineCore, EngineOptions  # noqa: E402
from scheduler_node.engine.model_path import resolve_model  # noqa: E402
from scheduler_node.engine.stand_in import StandInWorkers  # noqa: E402
from scheduler_node.text.tokenizer import ModelTokenizer  # noqa: E402

BLOCK = 16
PRIORITIES = (30, 50, 90)  # under `priority`, requests of three classes share the batch


@dataclass(slots=True)
class Step:
    """What the probe saw of one plan."""

    requests: int = 0
    tokens: int = 0
    new: int = 0
    schedule_s: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0  # the workers' side of the wire, not in the scheduler's sum
    plan_bytes: int = 0
    update_s: float = 0.0
    output_s: float = 0.0

    @property
    def scheduler_s(self) -> float:
        return self.schedule_s + self.encode_s + self.update_s


@dataclass(slots=True)
class Probe:
    """Times the engine's calls on one engine instance (its scheduler, its output path, its stand-in's plans) in
    this thread's CPU time, so that other processes on a shared machine do not count."""

    steps: dict[int, Step] = field(default_factory=dict)
    applied: Step | None = None  # the step whose result was applied last, its output path still running
    applied_at: float = 0.0

    def attach(self, engine: EngineCore, workers: StandInWorkers) -> None:
        scheduler = engine.scheduler
        schedule, update = scheduler.schedule, scheduler.update
        clock = time.thread_time

        def timed_schedule() -> StepPlan:
            start = clock()
            if self.applied is not None:  # nothing yields between the outputs of a result and the next schedule()
                self.applied.output_s = start - self.applied_at
                self.applied = None
            plan = schedule()
            elapsed = clock() - start
            tokens = plan.total_tokens
            self.steps[plan.step_id] = Step(len(plan.num_scheduled_tokens), tokens, len(plan.new_requests), elapsed)
            return plan

        def timed_update(plan: StepPlan, result: StepResult) -> list[RequestOutput]:
            start = clock()
            outputs = update(plan, result)
            self.applied_at = clock()
            self.applied = self.steps.get(plan.step_id)
            if self.applied is not None:
                self.applied.update_s = self.applied_at - start
            return outputs

        def wire(plan: StepPlan) -> None:
            start = clock()
            data = encode(plan)
            encoded = clock()
            decode(data)
            step = self.steps.get(plan.step_id)
            if step is not None:
                step.encode_s = encoded - start
                step.decode_s = clock() - encoded
                step.plan_bytes = len(data)

        scheduler.schedule = timed_schedule  # type: ignore[method-assign]
        scheduler.update = timed_update  # type: ignore[method-assign]
        workers.on_plan = wire

    def decode_steps(self, num_seqs: int) -> list[Step]:
        """Steps in which every one of `num_seqs` running requests decodes one token, in order."""
        return [s for _, s in sorted(self.steps.items()) if s.requests == num_seqs == s.tokens and not s.new]


def budget(num_seqs: int) -> int:
    """The step's token budget: prefill in few steps, every request decodes in one."""
    return max(16384, num_seqs)


def make_engine(
    num_seqs: int, max_len: int, policy: str, tokenizer: ModelTokenizer, budget: int, schedule_gc: bool = True
) -> tuple[EngineCore, StandInWorkers]:
    """An engine with the server's defaults where they matter (async scheduling, prefix caching, block 16, the
    collector's schedule) over stand-in workers that hold every request's whole context."""
    blocks = num_seqs * -(-max_len // BLOCK) + 64
    config = SchedulerConfig(
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        max_num_seqs=num_seqs,
        max_model_len=max_len,
    )
    mode = ExecutionMode.for_world(1, 1, async_scheduling=True)
    scheduler = Scheduler(config, blocks, make_policy(policy), mode)
    workers = StandInWorkers(blocks, token=tokenizer.tokenizer.token_to_id("a") or 65, block_size=BLOCK)
    return EngineCore(scheduler, tokenizer, workers, EngineOptions(schedule_gc=schedule_gc)), workers


def specs(count: int, prompt_len: int, max_tokens: int, seed: int, vocab: int) -> list[RequestSpec]:
    """Requests with distinct random prompts (no prefix hits), greedy, ignoring eos, in three priority classes, with
    ids like the doors' (uuid4 hex)."""
    rng = random.Random(seed)
    sampling = SamplingOptions(temperature=0.0)
    return [
        RequestSpec(
            f"{rng.getrandbits(128):032x}",
            [rng.randrange(100, vocab) for _ in range(prompt_len)],
            sampling,
            max_tokens,
            [],
            True,
            1,
            PRIORITIES[i % len(PRIORITIES)],
        )
        for i in range(count)
    ]


async def drive(engine: EngineCore, batch: list[RequestSpec]) -> None:
    """Submit every request, read every stream as a door does, and run the engine until all finished."""

    loop = asyncio.ensure_future(engine.run())
    readers = [asyncio.ensure_future(_drain(engine.submit(spec))) for spec in batch]
    streams: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*readers))
    await asyncio.wait({loop, streams}, return_when=asyncio.FIRST_COMPLETED)
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    if not all(r.done() and not r.cancelled() for r in readers):
        raise RuntimeError("the engine loop stopped before every request finished")


def measure(num_seqs: int, context: int, policy: str, args: argparse.Namespace, tokenizer: ModelTokenizer) -> dict:
    """`num_seqs` requests whose context is `context` tokens when the measured decode steps start."""
    # The first requests decode while the last ones prefill (under `priority` the lower classes' prefill waits for
    # the higher ones'): every request runs long enough to share `--warmup` + `--steps` decode steps with the rest.
    prefill_steps = -(-num_seqs * context // budget(num_seqs))
    max_tokens = 2 * prefill_steps + args.warmup + args.steps + 16
    engine, workers = make_engine(
        num_seqs, context + max_tokens + 1, policy, tokenizer, budget(num_seqs), not args.default_gc
    )
    probe = Probe()
    probe.attach(engine, workers)
    asyncio.run(drive(engine, specs(num_seqs, context, max_tokens, num_seqs + context, tokenizer.vocab_size)))
    steps = probe.decode_steps(num_seqs)[args.warmup : args.warmup + args.steps]
    if len(steps) < args.steps:
        raise RuntimeError(f"{num_seqs} x {context}: only {len(steps)} steps with every request decoding")
    sums = [s.scheduler_s for s in steps]
    return {
        "seqs": num_seqs,
        "context": context,
        "policy": policy,
        "steps": len(steps),
        "schedule_ms": _mean_ms(s.schedule_s for s in steps),
        "encode_ms": _mean_ms(s.encode_s for s in steps),
        "update_ms": _mean_ms(s.update_s for s in steps),
        "sum_ms": _mean_ms(sums),
        "sum_p99_ms": _percentile(sums, 0.99) * 1e3,
        "output_ms": _mean_ms(s.output_s for s in steps),
        "decode_ms": _mean_ms(s.decode_s for s in steps),
        "plan_bytes_per_seq": statistics.mean(s.plan_bytes for s in steps) / num_seqs,
    }


def measure_admission(count: int, prompt_len: int, tokenizer: ModelTokenizer) -> dict:
    """`count` new requests arrive at once into an idle engine: the step that admits them all."""
    engine, workers = make_engine(count, prompt_len + 2, "fcfs", tokenizer, count * prompt_len)
    probe = Probe()
    probe.attach(engine, workers)
    batch = specs(count, prompt_len, 1, count * 7, tokenizer.vocab_size)

    async def run() -> float:
        """CPU seconds the doors spent in submit()."""
        loop = asyncio.ensure_future(engine.run())
        start = time.thread_time()
        readers = [asyncio.ensure_future(_drain(engine.submit(spec))) for spec in batch]
        submitted = time.thread_time() - start
        await asyncio.gather(*readers)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        return submitted

    submit_s = asyncio.run(run())
    first = probe.steps[min(probe.steps)]
    if first.new != count:
        raise RuntimeError(f"the first step admitted {first.new} of {count} requests")
    return {
        "requests": count,
        "prompt": prompt_len,
        "submit_ms": submit_s * 1e3,
        "schedule_ms": first.schedule_s * 1e3,
        "encode_ms": first.encode_s * 1e3,
        "update_ms": first.update_s * 1e3,
        "schedule_us_per_request": first.schedule_s * 1e6 / count,
    }


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def _median_run(runs: list[dict]) -> dict:
    """Of a row's runs, the one whose scheduler sum is the median (every figure from that one run)."""
    return sorted(runs, key=lambda r: r["sum_ms"])[(len(runs) - 1) // 2] | {"runs": len(runs)}


def _mean_ms(values: Any) -> float:
    return statistics.mean(values) * 1e3


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def grid(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Every sequence count at the first context, and every context at `--context-seqs` sequences."""
    seqs = [int(x) for x in args.seqs.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    cells = [(n, contexts[0]) for n in seqs] + [(args.context_seqs, c) for c in contexts[1:]]
    return list(dict.fromkeys(cells))


def print_tables(rows: list[dict], admission: dict) -> None:
    print(
        "| policy | decode seqs | context | schedule() | encode(plan) | update() | sum | sum p99 | output path "
        "| plan bytes / seq | decode(plan) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['seqs']} | {r['context']} | {r['schedule_ms']:.3f} ms | {r['encode_ms']:.3f} ms "
            f"| {r['update_ms']:.3f} ms | {r['sum_ms']:.3f} ms | {r['sum_p99_ms']:.3f} ms | {r['output_ms']:.3f} ms "
            f"| {r['plan_bytes_per_seq']:.1f} | {r['decode_ms']:.3f} ms |"
        )
    a = admission
    print()
    print("| new requests | prompt | submit() | schedule() | per request | encode(plan) | update() |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {a['requests']} | {a['prompt']} | {a['submit_ms']:.2f} ms | {a['schedule_ms']:.2f} ms "
        f"| {a['schedule_us_per_request']:.1f} µs | {a['encode_ms']:.2f} ms | {a['update_ms']:.2f} ms |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="64,256,1024,4096", help="running decode sequences, comma-separated")
    p.add_argument("--contexts", default="200,1000,8000", help="context lengths in tokens, comma-separated")
    p.add_argument("--context-seqs", type=int, default=256, help="sequences for the rows beyond the first context")
    p.add_argument("--policies", default="fcfs,priority", help="scheduling policies, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="decode steps measured per row")
    p.add_argument("--warmup", type=int, default=20, help="decode steps run before measuring")
    p.add_argument("--admit", type=int, default=256, help="new requests admitted at once (the admission table)")
    p.add_argument("--model", default="default", help="the model whose tokenizer the engine uses (no weights)")
    p.add_argument(
        "--default-gc",
        action="store_true",
        help="leave the interpreter's collector as it is (no engine/collector.py schedule), to compare",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every row this many times, round robin, and report each row's run of median sum",
    )
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--smoke", action="store_true", help="a few small rows (CI)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.smoke:
        args.seqs, args.contexts, args.context_seqs = "8,32", "40,100", 8
        args.steps, args.warmup, args.admit = 10, 2, 16
    tokenizer = ModelTokenizer(resolve_model(args.model))
    cells = [(policy, n, c) for policy in args.policies.split(",") for n, c in grid(args)]
    runs: dict[tuple[str, int, int], list[dict]] = {cell: [] for cell in cells}
    for _ in range(args.repeat):  # round robin: a noisy minute on a shared machine hits one run of each row
        for policy, num_seqs, context in cells:
            runs[policy, num_seqs, context].append(measure(num_seqs, context, policy, args, tokenizer))
            print(json.dumps(runs[policy, num_seqs, context][-1]), file=sys.stderr, flush=True)
    rows = [_median_run(runs[cell]) for cell in cells]
    admission = measure_admission(args.admit, 200, tokenizer)
    print_tables(rows, admission)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "admission": admission}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
