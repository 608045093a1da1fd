"""T tensor-parallel ranks (of each of P pipeline stages) of one model in one process, joined over gloo exactly as
worker processes join (worker_node.runtime.parallel.connect): the model shards, their collectives and the stages'
hand-offs are the real ones, without paying T x P process start-ups per test. The engine core drives them through
InProcessWorkers, one step thread per rank."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from minivllm.cluster import free_port
from proto.parallel import ParallelLayout
from tests.support.engine import load_runner
from worker_node.inprocess import InProcessWorkers
from worker_node.runtime.parallel import ParallelRank, connect


class TensorParallelRanks:
    def __init__(self, folder: Path, num_blocks: int, block_size: int, tp: int = 2, pp: int = 1, **worker: Any) -> None:
        """`worker`: more WorkerOptions for every rank (offload tiers)."""
        self.layout = layout = ParallelLayout(tp, pp)
        ranks = [ParallelRank(layout, r) for r in range(layout.world_size)]
        address = f"127.0.0.1:{free_port()}"
        with ThreadPoolExecutor(len(ranks)) as pool:  # the rendezvous completes only when every rank has joined
            joins = [pool.submit(connect, w, address, "127.0.0.1", torch.device("cpu"), 30.0) for w in ranks]
            self.comms = [j.result(timeout=60) for j in joins]
        self.runners = [
            load_runner(folder, num_blocks, block_size, where=w, comm=c, **worker) for w, c in zip(ranks, self.comms)
        ]

    def transport(self) -> InProcessWorkers:
        return InProcessWorkers(runners=self.runners, output_rank=self.layout.output_rank)  # TP rank 0, last stage

    def close(self) -> None:
        for comm in self.comms:
            comm.close()
