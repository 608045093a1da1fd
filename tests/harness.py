"""The scheduler and a model runner wired in-process, every plan and result through the msgpack wire."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.backend import select_attention_backend
from proto.wire import SamplingOptions, decode, encode
from scheduler_node.config import SchedulerConfig
from scheduler_node.request import Request, StopConditions
from scheduler_node.scheduler import Scheduler
from worker_node.kv_cache import allocate_kv_cache, bytes_per_block
from worker_node.model_runner import ModelRunner
from worker_node.models.config import ModelConfig
from worker_node.models.loader import load_model

CPU = torch.device("cpu")


def make_runner(folder: Path, num_blocks: int, block_size: int, backend: str = "torch") -> ModelRunner:
    config = ModelConfig.from_folder(folder)
    model = load_model(folder, select_attention_backend(backend, CPU), torch.float32, CPU, config.max_model_len)
    budget = num_blocks * bytes_per_block(config, block_size, torch.float32)
    return ModelRunner(model, allocate_kv_cache(config, block_size, torch.float32, CPU, budget), block_size, CPU)


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
) -> tuple[list[Request], Scheduler]:
    config = SchedulerConfig(
        block_size=runner.block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=runner.model.config.max_model_len,
    )
    scheduler = Scheduler(config, num_blocks)
    requests = [
        Request(f"r{i}", p, sampling or SamplingOptions(temperature=0.0), StopConditions(m, eos))
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    for req in requests:
        scheduler.add(req)
    steps = 0
    while scheduler.has_work:
        plan = decode(encode(scheduler.schedule()))
        result = decode(encode(runner.execute(plan)))  # type: ignore[arg-type]
        scheduler.update(result)  # type: ignore[arg-type]
        steps += 1
        assert steps < 10_000, "the engine made no progress"
    return requests, scheduler
