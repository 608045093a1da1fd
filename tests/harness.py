"""The scheduler and a model runner wired in-process, every plan and result through the msgpack wire."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kernels.backend import select_attention_backend
from proto.wire import SamplingOptions, StepPlan, StepResult, decode, encode
from scheduler_node.config import SchedulerConfig
from scheduler_node.request import Request, StopConditions
from scheduler_node.scheduler import PreemptionCosts, Scheduler
from worker_node.kv_cache import allocate_host_cache, allocate_kv_cache, bytes_per_block
from worker_node.model_runner import ModelRunner
from worker_node.models.config import ModelConfig
from worker_node.models.loader import load_model

CPU = torch.device("cpu")


def make_runner(
    folder: Path, num_blocks: int, block_size: int, backend: str = "torch", num_host_blocks: int = 0
) -> ModelRunner:
    config = ModelConfig.from_folder(folder)
    model = load_model(folder, select_attention_backend(backend, CPU), torch.float32, CPU, config.max_model_len)
    block_bytes = bytes_per_block(config, block_size, torch.float32)
    cache = allocate_kv_cache(config, block_size, torch.float32, CPU, num_blocks * block_bytes)
    host = allocate_host_cache(config, block_size, torch.float32, CPU, num_host_blocks * block_bytes)
    return ModelRunner(model, cache, block_size, CPU, host if num_host_blocks else None)


class OfflineEngine:
    """`plans_in_flight=2` models async scheduling: plan N+1 is built before the result of step N is seen,
    while the worker runs the plans in order, as the real worker does."""

    def __init__(
        self, runner: ModelRunner, num_blocks: int, num_host_blocks: int = 0, plans_in_flight: int = 1, **config: Any
    ) -> None:
        self.runner = runner
        self.plans_in_flight = plans_in_flight
        self._pending: list[tuple[StepPlan, StepResult]] = []
        cfg = SchedulerConfig(block_size=runner.block_size, max_model_len=runner.model.config.max_model_len, **config)
        costs = PreemptionCosts(bytes_per_block=1, swap_bytes_per_s=1e12)  # elastic: swap when space allows
        self.scheduler = Scheduler(cfg, num_blocks, num_host_blocks=num_host_blocks, costs=costs)
        self.plans: list[StepPlan] = []
        self._ids = 0

    def add(
        self,
        prompt: list[int],
        max_tokens: int,
        n: int = 1,
        sampling: SamplingOptions | None = None,
        eos: frozenset[int] = frozenset(),
    ) -> list[Request]:
        sampling = sampling or SamplingOptions(temperature=0.0)
        seqs = []
        for i in range(n):
            seeded = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)
            seqs.append(Request(f"r{self._ids}.{i}", prompt, seeded, StopConditions(max_tokens, eos)))
        self._ids += 1
        self.scheduler.add(seqs[0], forks=seqs[1:])
        return seqs

    def step(self) -> None:
        while len(self._pending) < self.plans_in_flight and self.scheduler.has_work:
            plan = decode(encode(self.scheduler.schedule()))
            assert isinstance(plan, StepPlan)
            if not (plan.num_scheduled_tokens or plan.finished_req_ids or plan.preempted_req_ids):
                break
            result = decode(encode(self.runner.execute(plan)))
            assert isinstance(result, StepResult)
            self._pending.append((plan, result))
            self.plans.append(plan)
        if self._pending:
            plan, result = self._pending.pop(0)
            self.scheduler.update(plan, result)

    def run(self, max_steps: int = 10_000) -> None:
        while self.scheduler.has_work or self._pending:
            assert len(self.plans) < max_steps, "the engine made no progress"
            self.step()


def run_offline(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    num_blocks: int,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    sampling: SamplingOptions | None = None,
    eos: frozenset[int] = frozenset(),
    **config: Any,
) -> tuple[list[Request], Scheduler]:
    engine = OfflineEngine(
        runner, num_blocks, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, **config
    )
    requests = [engine.add(p, m, sampling=sampling, eos=eos)[0] for p, m in zip(prompts, max_tokens)]
    engine.run()
    return requests, engine.scheduler
