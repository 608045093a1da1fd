"""T tensor-parallel ranks of one model in one process, one thread each, joined over gloo exactly as worker
processes join (worker_node.parallel.connect): the model shards and their collectives are the real ones, without
paying T process start-ups per test. `execute` runs a plan on every rank and answers with the output rank's
result, so the offline engine of tests/harness.py drives it like one ModelRunner."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from proto.parallel import ParallelLayout
from proto.wire import StepPlan, StepResult, decode, encode
from tests.harness import make_runner
from tests.servers import free_port
from worker_node.model_runner import ModelRunner
from worker_node.parallel import ParallelRank, connect


class ThreadedTensorParallel:
    def __init__(self, folder: Path, num_blocks: int, block_size: int, tp: int = 2, backend: str = "auto") -> None:
        layout = ParallelLayout(tp, 1)
        ranks = [ParallelRank(layout, r) for r in range(tp)]
        address = f"127.0.0.1:{free_port()}"
        self._pool = ThreadPoolExecutor(tp, thread_name_prefix="tp-rank")
        # The rendezvous completes only when every rank has joined: all of them at once.
        joins = [self._pool.submit(connect, w, address, "127.0.0.1", torch.device("cpu"), 30.0) for w in ranks]
        self.comms = [j.result(timeout=60) for j in joins]
        self.runners: list[ModelRunner] = [
            make_runner(folder, num_blocks, block_size, backend, where=w, comm=c) for w, c in zip(ranks, self.comms)
        ]
        self.block_size = block_size
        self.model = self.runners[0].model

    def execute(self, plan: StepPlan) -> StepResult:
        copies = [decode(encode(plan)) for _ in self.runners]  # each rank its own, as each worker decodes its own
        answers = [self._pool.submit(r.execute, p) for r, p in zip(self.runners, copies)]
        results = [a.result(timeout=120) for a in answers]
        return results[0]  # TP rank 0 of the only stage: the output rank

    def close(self) -> None:
        for comm in self.comms:
            comm.close()
        self._pool.shutdown()
