"""The default CPU KV budget: a quarter of free RAM for the whole world on a host, not for each of its ranks
(four ranks that each took a quarter of what they saw free at the same moment filled the RAM and met the OOM
killer, with default flags, in the TP 2 x PP 2 chaos test)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from minivllm.cluster import free_port
from proto.parallel import ParallelLayout
from worker_node.kv import cache as kv_cache
from worker_node.runtime.parallel import ParallelRank, connect

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_the_ranks_on_a_host_share_a_quarter_of_its_free_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 16 << 30)
    assert kv_cache.kv_cache_budget(CPU, None, 0.9) == 4 << 30
    assert kv_cache.kv_cache_budget(CPU, None, 0.9, ranks_on_host=4) == 1 << 30
    assert kv_cache.kv_cache_budget(CPU, 3 << 30, 0.9, ranks_on_host=4) == 3 << 30  # an explicit size wins


def test_each_rank_learns_how_many_ranks_share_its_host() -> None:
    layout = ParallelLayout(2, 2)
    address = f"127.0.0.1:{free_port()}"
    with ThreadPoolExecutor(4) as pool:
        joins = [pool.submit(connect, ParallelRank(layout, r), address, "127.0.0.1", CPU, 30.0) for r in range(4)]
        comms = [j.result(timeout=60) for j in joins]
    try:
        assert [c.ranks_on_host for c in comms] == [4, 4, 4, 4]
    finally:
        for c in comms:
            c.close()
