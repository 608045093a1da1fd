"""What an assembled world holds (proto/transport.py: the offload tiers and the compact pool every rank has) and
how its KV memory is reported in bytes (proto/memory_stats.py)."""

from __future__ import annotations

import pytest

from proto.memory_stats import DEVICE, KvPool
from proto.transport import WorldCapacity, compact_capacity, tier_capacity
from proto.wire import WorkerReady

pytestmark = pytest.mark.unit


def ready(rank: int, **kw: object) -> WorkerReady:
    return WorkerReady(rank, 100, 100_000, **kw)  # type: ignore[arg-type]


def test_the_tiers_are_the_smallest_ranks_and_a_disk_block_is_whole_only_on_every_rank() -> None:
    a = ready(0, num_ram_tier_blocks=8, num_disk_tier_blocks=20, disk_tier_blocks=[(1, b"x"), (2, b"y"), (3, b"z")])
    b = ready(1, num_ram_tier_blocks=6, num_disk_tier_blocks=30, disk_tier_blocks=[(3, b"z"), (1, b"x"), (2, b"q")])
    assert tier_capacity([a, b]) == {"ram_tier_blocks": 6, "disk_tier_blocks": 20,
                                     "disk_tier_entries": ((1, b"x"), (3, b"z"))}  # fmt: skip
    assert tier_capacity([]) == {}


def test_the_compact_pool_exists_only_when_every_rank_holds_one() -> None:
    a = ready(0, num_compact_blocks=40, compact_cache_bytes=4000, compact_format="int8")
    b = ready(1, num_compact_blocks=50, compact_cache_bytes=10_000, compact_format="int8")
    assert compact_capacity([a, b]) == {"num_compact_blocks": 40, "compact_world_bytes_per_block": 100 + 200,
                                        "compact_format": "int8"}  # fmt: skip
    assert compact_capacity([a, ready(1)]) == {}, "one rank without the pool: no pool"
    capacity = WorldCapacity(10, 0, 64, 0.0, **compact_capacity([a, b]))
    assert capacity.num_compact_blocks == 40


def test_a_pool_reports_its_bytes() -> None:
    pool = KvPool(DEVICE, "float32", bytes_per_block=1024, total_blocks=10, used_blocks=3, hits=16)
    assert (pool.allocated_bytes, pool.used_bytes) == (10 * 1024, 3 * 1024)
