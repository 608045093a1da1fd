"""What an assembled world holds (proto/transport.py: WorldCapacity.of every rank's Ready, offload tiers and the
compact pool included) and how its KV memory is reported in bytes (proto/memory_stats.py)."""

from __future__ import annotations

import pytest

from proto.memory_stats import DEVICE, KvPool
from proto.transport import WorldCapacity
from proto.wire import WorkerReady

pytestmark = pytest.mark.unit


def ready(rank: int, **kw: object) -> WorkerReady:
    return WorkerReady(rank, 100, 100_000, **kw)  # type: ignore[arg-type]


def test_the_world_holds_what_its_smallest_rank_holds() -> None:
    a = WorkerReady(0, 100, 100 * 1000, num_host_blocks=8, swap_bytes_per_s=2e9, kv_format="bfloat16")
    b = WorkerReady(1, 80, 80 * 2000, num_host_blocks=10, swap_bytes_per_s=1e9, kv_format="bfloat16")
    capacity = WorldCapacity.of([a, b])
    assert (capacity.num_kv_blocks, capacity.num_swap_blocks, capacity.swap_bytes_per_s) == (80, 8, 1e9)
    assert (capacity.bytes_per_block, capacity.world_bytes_per_block) == (2000, 3000)  # the largest; the sum
    assert capacity.kv_format == "bfloat16"


def test_the_tiers_are_the_smallest_ranks_and_a_disk_block_is_whole_only_on_every_rank() -> None:
    a = ready(0, num_ram_tier_blocks=8, num_disk_tier_blocks=20, disk_tier_blocks=[(1, b"x"), (2, b"y"), (3, b"z")])
    b = ready(1, num_ram_tier_blocks=6, num_disk_tier_blocks=30, disk_tier_blocks=[(3, b"z"), (1, b"x"), (2, b"q")])
    capacity = WorldCapacity.of([a, b])
    assert (capacity.ram_tier_blocks, capacity.disk_tier_blocks) == (6, 20)
    assert capacity.disk_tier_entries == ((1, b"x"), (3, b"z"))


def test_the_compact_pool_exists_only_when_every_rank_holds_one() -> None:
    a = ready(0, num_compact_blocks=40, compact_cache_bytes=4000, compact_format="int8")
    b = ready(1, num_compact_blocks=50, compact_cache_bytes=10_000, compact_format="int8")
    capacity = WorldCapacity.of([a, b])
    assert (capacity.num_compact_blocks, capacity.compact_world_bytes_per_block) == (40, 100 + 200)
    assert capacity.compact_format == "int8"
    assert WorldCapacity.of([a, ready(1)]).num_compact_blocks == 0, "one rank without the pool: no pool"


def test_a_pool_reports_its_bytes() -> None:
    pool = KvPool(DEVICE, "float32", bytes_per_block=1024, total_blocks=10, used_blocks=3, hits=16)
    assert (pool.allocated_bytes, pool.used_bytes) == (10 * 1024, 3 * 1024)
