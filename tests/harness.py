"""The scheduler and a model runner (or a pipeline of stage runners) wired in-process, every plan and result
through the msgpack wire."""

from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from kernels.backend import select_attention_backend
from proto.parallel import ParallelLayout
from proto.wire import SamplingOptions, StepPlan, StepResult, decode, encode
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.request import Request, StopConditions
from scheduler_node.core.scheduler import PreemptionCosts, Scheduler
from worker_node.kv_cache import allocate_host_cache, allocate_kv_cache, bytes_per_block
from worker_node.model_runner import ModelRunner
from worker_node.models.config import ModelConfig
from worker_node.models.loader import load_model
from worker_node.parallel import SINGLE, Comm, ParallelRank
from worker_node.worker import shard_config

CPU = torch.device("cpu")


def make_runner(
    folder: Path,
    num_blocks: int,
    block_size: int,
    backend: str = "auto",
    num_host_blocks: int = 0,
    where: ParallelRank = SINGLE,
    comm: Comm | None = None,
    dtype: torch.dtype = torch.float32,  # the fidelity reference; bf16 tests ask for theirs
) -> ModelRunner:
    full = ModelConfig.from_folder(folder)
    config = shard_config(full, where)
    backend_impl = select_attention_backend(backend, CPU)
    model = load_model(folder, backend_impl, dtype, CPU, full.max_model_len, where, comm)
    block_bytes = bytes_per_block(config, block_size, dtype)
    cache = allocate_kv_cache(config, block_size, dtype, CPU, num_blocks * block_bytes)
    host = allocate_host_cache(config, block_size, dtype, CPU, num_host_blocks * block_bytes)
    return ModelRunner(model, cache, block_size, CPU, host if num_host_blocks else None, comm)


class HandOff:
    """Hidden states from one stage to the next. Like gloo's send, `send` returns once the receiver took them.

    `hold`: the receiver, once it took the first states, goes on only after the sender reached its send this
    many times: a pipeline whose first stage runs ahead (plan N+1 while the next stage is still on plan N)
    passes; stages in lock-step, or a scheduler that leaves the next plan empty, time out."""

    def __init__(self, hold: int = 0, timeout: float = 30.0) -> None:
        self.hold = hold
        self.timeout = timeout
        self._states: queue.Queue[torch.Tensor] = queue.Queue()
        self._sends = 0
        self._sent = threading.Condition()

    def send(self, x: torch.Tensor) -> None:
        with self._sent:
            self._sends += 1
            self._sent.notify_all()
        self._states.put(x.clone())
        self._states.join()

    def recv(self) -> torch.Tensor:
        x = self._states.get(timeout=self.timeout)
        self._states.task_done()
        with self._sent:
            if not self._sent.wait_for(lambda: self._sends >= self.hold, self.timeout):
                raise TimeoutError(f"the previous stage did not run ahead to its send {self.hold}")
            self.hold = 0
        return x


class StageComm(Comm):
    """One in-process stage of a TP 1 pipeline: hidden states through HandOffs, no collective across stages."""

    def __init__(self, where: ParallelRank, previous: HandOff | None, following: HandOff | None) -> None:
        super().__init__(where)
        self.previous = previous
        self.following = following

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        assert self.following is not None
        self.following.send(x)

    def recv_from_previous_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.previous is not None
        x = self.previous.recv()
        assert x.shape == shape and x.dtype == dtype, (x.shape, shape)
        return x

    def share_sampled(self, tokens: list[int], count: int) -> list[int]:
        raise AssertionError("with several stages the sampled tokens travel in the next plan, not a broadcast")


class StagePipeline:
    """P stage runners on P threads, each running the plans in order as P workers do. `hold` goes to the first
    hand-off (see HandOff). `submit` answers with the output stage's result."""

    def __init__(self, folder: Path, num_blocks: int, block_size: int, stages: int = 2, hold: int = 0) -> None:
        layout = ParallelLayout(1, stages)
        hand_offs = [HandOff(hold if s == 0 else 0) for s in range(stages - 1)]
        self.runners = []
        for s in range(stages):
            where = ParallelRank(layout, s)
            comm = StageComm(where, hand_offs[s - 1] if s else None, hand_offs[s] if s < stages - 1 else None)
            self.runners.append(make_runner(folder, num_blocks, block_size, where=where, comm=comm))
        self.block_size = block_size
        self.model = self.runners[-1].model
        self._inboxes: list[queue.Queue[tuple[StepPlan, Future[StepResult]] | None]] = [
            queue.Queue() for _ in range(stages)
        ]
        for s in range(stages):
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        result: Future[StepResult] = Future()
        for inbox in self._inboxes:
            copy = decode(encode(plan))  # each stage its own, as each worker decodes its own
            assert isinstance(copy, StepPlan)
            inbox.put((copy, result))
        return result

    def _serve(self, stage: int) -> None:
        runner, last = self.runners[stage], stage == len(self.runners) - 1
        while (job := self._inboxes[stage].get()) is not None:
            plan, result = job
            try:
                answer = runner.execute(plan)
            except Exception as exc:
                if not result.done():
                    result.set_exception(exc)
                continue
            if last and not result.done():
                result.set_result(answer)

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)


class OfflineEngine:
    """`plans_in_flight=2` models async scheduling: plan N+1 is built before the result of step N is seen,
    while the worker runs the plans in order, as the real worker does. With a StagePipeline, the scheduler
    plans for its P stages, and `plans_in_flight=P` keeps them all busy."""

    def __init__(
        self,
        runner: ModelRunner | StagePipeline,
        num_blocks: int,
        num_host_blocks: int = 0,
        plans_in_flight: int = 1,
        **config: Any,
    ) -> None:
        self.runner = runner
        self.plans_in_flight = plans_in_flight
        self._pending: list[tuple[StepPlan, Future[StepResult]]] = []
        if isinstance(runner, StagePipeline):
            config.setdefault("pipeline_parallel_size", len(runner.runners))
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
            self._pending.append((plan, self._submit(plan)))
            self.plans.append(plan)
        if self._pending:
            plan, answer = self._pending.pop(0)
            result = decode(encode(answer.result(timeout=120)))
            assert isinstance(result, StepResult)
            self.scheduler.update(plan, result)

    def _submit(self, plan: StepPlan) -> Future[StepResult]:
        if isinstance(self.runner, StagePipeline):
            return self.runner.submit(plan)
        done: Future[StepResult] = Future()
        done.set_result(self.runner.execute(plan))
        return done

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
