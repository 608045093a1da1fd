"""WorldCapacity.of: the one way a world's capacity is assembled from its ranks' Ready messages (the ZeroMQ
transport and the in-process one both use it)."""

from __future__ import annotations

import pytest

from proto.transport import WorldCapacity
from proto.wire import WorkerReady

pytestmark = pytest.mark.unit


def ready(rank: int, blocks: int, block_bytes: int, **more: object) -> WorkerReady:
    return WorkerReady(rank, blocks, blocks * block_bytes, **more)  # type: ignore[arg-type]


def test_the_world_holds_what_its_smallest_rank_holds() -> None:
    cap = WorldCapacity.of([
        ready(0, 100, 10, num_host_blocks=8, swap_bytes_per_s=5.0, kv_format="bfloat16"),
        ready(1, 90, 12, num_host_blocks=9, swap_bytes_per_s=3.0, kv_format="bfloat16"),
    ])  # fmt: skip
    assert (cap.num_kv_blocks, cap.num_swap_blocks, cap.swap_bytes_per_s) == (90, 8, 3.0)
    assert (cap.bytes_per_block, cap.world_bytes_per_block, cap.kv_format) == (12, 22, "bfloat16")
    assert (cap.num_compact_blocks, cap.ram_tier_blocks, cap.disk_tier_entries) == (0, 0, ())


def test_tiers_and_compact_pools_count_only_what_every_rank_has() -> None:
    h1, h2 = b"a" * 16, b"b" * 16
    cap = WorldCapacity.of([
        ready(0, 10, 1, num_ram_tier_blocks=4, num_disk_tier_blocks=8, disk_tier_blocks=[(0, h1), (1, h2)],
              num_compact_blocks=6, compact_cache_bytes=60, compact_format="int8"),
        ready(1, 10, 1, num_ram_tier_blocks=5, num_disk_tier_blocks=7, disk_tier_blocks=[(1, h2)],
              num_compact_blocks=5, compact_cache_bytes=40, compact_format="int8"),
    ])  # fmt: skip
    assert (cap.ram_tier_blocks, cap.disk_tier_blocks, cap.disk_tier_entries) == (4, 7, ((1, h2),))
    assert (cap.num_compact_blocks, cap.compact_world_bytes_per_block, cap.compact_format) == (5, 18, "int8")
    no_pool = WorldCapacity.of([ready(0, 10, 1, num_compact_blocks=6, compact_cache_bytes=60), ready(1, 10, 1)])
    assert no_pool.num_compact_blocks == 0, "a pool some rank lacks is no pool"
