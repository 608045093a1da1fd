"""Tests drive the engine core, the same class every door uses, over in-process workers (no sockets).

`load_runner` builds one rank as a worker does (worker_node/loading.py) with a pinned KV size; `EngineRun` puts an
EngineCore over InProcessWorkers holding such runners and runs it on its own event loop until every request added
so far has finished. Plans and results go through the msgpack wire, as behind a socket.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from proto.transport import WorldCapacity
from proto.wire import Assignment, ExecutionMode, SamplingOptions, StepPlan, TokenLogprobs, WorkerReady
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv.tier_index import KVTiers
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.core.request import RequestSpec
from scheduler_node.core.scheduler import PreemptionCosts, Scheduler
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.worker import WorkerOptions
from tests.support.waiting import until
from worker_node.inprocess import InProcessWorkers
from worker_node.loading import load_rank
from worker_node.model_runner import ModelRunner
from worker_node.runtime.parallel import SINGLE, Comm, ParallelRank

CPU = torch.device("cpu")


def load_runner(
    folder: Path,
    num_blocks: int,
    block_size: int = 16,
    backend: str = "auto",
    num_host_blocks: int = 0,
    mode: ExecutionMode | None = None,
    where: ParallelRank = SINGLE,
    comm: Comm | None = None,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
    quantization: str = "auto",
    draft_model: Path | None = None,
    num_speculative_tokens: int = 4,
    **worker: Any,
) -> ModelRunner:
    """One rank of `folder`'s model on the CPU, holding exactly `num_blocks` KV blocks (and the execution mode of
    its world with async scheduling, unless `mode` says otherwise), with `draft_model` as its speculative decoding
    draft when given. `worker`: more WorkerOptions (offload tiers)."""
    layout = where.layout
    assignment = Assignment(
        rank=where.rank,
        world_size=layout.world_size,
        model=str(folder),
        dtype=dtype,
        block_size=block_size,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
        tensor_parallel_size=layout.tensor_parallel_size,
        pipeline_parallel_size=layout.pipeline_parallel_size,
        device="cpu",
        mode=mode or ExecutionMode.for_world(layout.tensor_parallel_size, layout.pipeline_parallel_size, True),
        num_kv_blocks=num_blocks,
        num_swap_blocks=num_host_blocks,
        quantization=quantization,
        draft_model=str(draft_model or ""),
        num_speculative_tokens=num_speculative_tokens if draft_model else 0,
        draft_max_seqs=8 if draft_model else 0,
    )
    options = WorkerOptions(attention_backend=backend, kv_cache_dtype=kv_cache_dtype, **worker)
    runner, _ = load_rank(assignment, options, CPU, comm or Comm(where))
    return runner


@dataclass(slots=True)
class Completion:
    """One sequence's output, as the engine streamed it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str = ""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class Submitted:
    prompt: list[int]
    max_tokens: int
    completions: list[Completion]
    stream: Any = None
    request_id: str = ""

    @property
    def output(self) -> list[int]:
        """The first completion's tokens."""
        return self.completions[0].token_ids


class EngineRun:
    """An EngineCore over in-process runners, run to completion on demand (`run`)."""

    def __init__(
        self,
        runners: ModelRunner | list[ModelRunner],
        *,
        tokenizer_dir: Path,
        async_scheduling: bool = True,
        options: EngineOptions | None = None,
        transport: InProcessWorkers | None = None,
        **config: Any,
    ) -> None:
        runners = runners if isinstance(runners, list) else [runners]
        first = runners[0]
        self.mode = first.mode if async_scheduling else msgspec.structs.replace(first.mode, plans_in_flight=1)
        cfg = SchedulerConfig(block_size=first.block_size, max_model_len=first.model.config.max_model_len, **config)
        costs = PreemptionCosts(bytes_per_block=1, swap_bytes_per_s=1e12)  # elastic: swap when space allows
        scheduler = Scheduler(
            cfg,
            first.num_blocks,
            mode=self.mode,
            num_host_blocks=first.moves.num_host_blocks,
            costs=costs,
            tiers=_tiers_of(runners, cfg.kv_offload_policy),
        )
        self.workers = transport or InProcessWorkers(runners=runners, output_rank=len(runners) - 1)
        self.workers.runners = runners
        self.plans: list[StepPlan] = []
        self.workers.on_plan = self.plans.append
        self.engine = EngineCore(scheduler, ModelTokenizer(tokenizer_dir), self.workers, options or EngineOptions())
        self.scheduler = scheduler
        self.submitted: list[Submitted] = []
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None

    def add(
        self,
        prompt: list[int],
        max_tokens: int,
        n: int = 1,
        sampling: SamplingOptions | None = None,
        ignore_eos: bool = True,
        stop: list[str] | None = None,
        priority: int = 50,
        stop_token_ids: list[int] | None = None,
        lora: LoraRef | None = None,
        speculate: bool = True,
        **spec_fields: Any,
    ) -> Submitted:
        spec = RequestSpec(
            request_id=f"r{next(self._ids)}",
            prompt_token_ids=list(prompt),
            sampling=sampling or SamplingOptions(temperature=0.0),
            max_tokens=max_tokens,
            stop=stop or [],
            ignore_eos=ignore_eos,
            n=n,
            priority=priority,
            stop_token_ids=stop_token_ids or [],
            lora=lora,
            speculate=speculate,
            **spec_fields,
        )
        entry = Submitted(list(prompt), max_tokens, [Completion() for _ in range(n)], request_id=spec.request_id)
        self._loop.run_until_complete(self._submit(spec, entry))
        self.submitted.append(entry)
        return entry

    async def _submit(self, spec: RequestSpec, entry: Submitted) -> None:
        if self._task is None:
            await self.workers.start(_built_already, 60.0)
            self._task = asyncio.get_running_loop().create_task(self.engine.run())
        entry.stream = self.engine.submit(spec)

    def run(self, timeout: float = 300.0) -> None:
        """Until every request added so far has finished; collects their outputs."""
        self._loop.run_until_complete(asyncio.wait_for(self._until_idle(), timeout))
        for entry in self.submitted:
            for delta in entry.stream.take_ready():
                c = entry.completions[delta.index]
                c.token_ids += delta.token_ids
                c.text += delta.text
                c.logprobs += delta.logprobs
                c.prompt_logprobs += delta.prompt_logprobs
                c.finish_reason = delta.finish_reason or c.finish_reason
                c.error = delta.error.message if delta.error else c.error

    def serve(self, scenario: Callable[[], Awaitable[None]], timeout: float = 300.0) -> None:
        """Run `scenario` (a door over `self.engine`, say) on this run's loop with the engine running."""

        async def main() -> None:
            if self._task is None:
                await self.workers.start(_built_already, 60.0)
                self._task = asyncio.get_running_loop().create_task(self.engine.run())
            await asyncio.wait_for(scenario(), timeout)

        self._loop.run_until_complete(main())

    def run_until(self, predicate: Callable[[], object], what: str, timeout: float = 60.0) -> None:
        """Run the engine until `predicate()` holds (TimeoutError naming `what` after `timeout` seconds)."""
        self._loop.run_until_complete(until(predicate, timeout, what))

    def run_plans(self, count: int, timeout: float = 120.0) -> None:
        """Until the engine has sent `count` plans in all (requests may still be running)."""

        task = self._task
        assert task is not None
        self._loop.run_until_complete(until(lambda: len(self.plans) >= count or task.done(), timeout, "plans sent"))
        assert not task.done(), "the engine stopped"

    async def _until_idle(self) -> None:
        assert self._task is not None
        idle = asyncio.ensure_future(self.engine.wait_idle())
        await asyncio.wait({idle, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            idle.cancel()
            self._task.result()  # the engine failed: raise its error

    def close(self) -> None:
        async def stop() -> None:
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            await self.workers.close("test over")

        self._loop.run_until_complete(stop())
        self._loop.close()

    def __enter__(self) -> EngineRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InterruptingWorkers(InProcessWorkers):
    """Asked to interrupt, it stops the running plan at a random layer boundary half the time (a forward hook),
    else before it starts; the plans queued behind it are skipped before they start."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng
        self.mid_forward = 0
        self.before_start = 0

    def interrupt(self, first: int, last: int) -> bool:
        runner = self.runners[0]
        layers = runner.model.layers
        if self.rng.random() < 0.5 and len(layers) > 1:
            self.mid_forward += 1
            hook = None

            def stop_now(*_: object) -> None:
                runner.interrupts.add(first, last)
                assert hook is not None
                hook.remove()

            hook = layers[self.rng.randrange(len(layers) - 1)].register_forward_hook(stop_now)
        else:
            self.before_start += 1
            runner.interrupts.add(first, last)
        return True


def generate(
    folder: Path, runner: ModelRunner, prompts: list[list[int]], max_tokens: list[int], **config: Any
) -> tuple[list[list[int]], Scheduler]:
    """Greedy outputs of these prompts (no eos), and the scheduler that ran them."""
    with EngineRun(runner, tokenizer_dir=folder, **config) as run:
        submitted = [run.add(p, m) for p, m in zip(prompts, max_tokens)]
        run.run()
    return [s.output for s in submitted], run.scheduler


def _tiers_of(runners: list[ModelRunner], policy: str) -> KVTiers | None:
    """The scheduler's tier index for runners built with offload tiers, as make_engine builds it."""
    offloads = [r.moves.offload for r in runners if r.moves.offload is not None]
    if len(offloads) != len(runners):
        return None
    cap = WorldCapacity.of([o.report(WorkerReady(0, 0, 0)) for o in offloads])
    tiers = KVTiers(cap.ram_tier_blocks, cap.disk_tier_blocks, policy)
    tiers.adopt_disk(cap.disk_tier_entries)
    return tiers


def _built_already(rank: int) -> Assignment:
    raise AssertionError("the runners are built already")
