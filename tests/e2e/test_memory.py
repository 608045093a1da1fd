"""The memory manager seen from outside: prefix-cache stats, cache_salt, forks, ResizeCache, `vllm-client stats`."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from minivllm.cluster import REPO, Cluster
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.support.clusters import SHARED
from tests.support.clusters import control_stats as stats

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. " * 12  # ~70 tokens: several full blocks shared by every request


@pytest.fixture
def cluster(shared_cluster: Cluster) -> Cluster:
    return shared_cluster  # the shared world (tests/support/clusters.py): block size 16, swap space on


def generate(stub: pb_grpc.GenerationStub, prompt: str, salt: str = "", n: int = 1) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        prompt=prompt,
        cache_salt=salt,
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=n),
    )
    return list(stub.Generate(request, timeout=60))


def test_prefix_hits_are_counted_and_salt_isolates(cluster: Cluster) -> None:
    stub = pb_grpc.GenerationStub(cluster.channel)
    generate(stub, SYSTEM + "first question")
    before = stats(cluster)
    generate(stub, SYSTEM + "second question")
    after = stats(cluster)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 48  # at least three shared blocks
    generate(stub, SYSTEM + "third question", salt="tenant-b")
    assert stats(cluster).prefix_cache_hits == after.prefix_cache_hits  # another tenant's chain: no hit
    s = stats(cluster)
    assert 0 < s.prefix_cache_hit_rate < 1
    assert s.cached_free_blocks > 0 and s.used_blocks == 0 and s.fragmentation == 0


def test_n3_streams_every_index(cluster: Cluster) -> None:
    deltas = generate(pb_grpc.GenerationStub(cluster.channel), SYSTEM + "fork me", n=3)
    assert sorted(d.index for d in deltas if d.finish_reason) == [0, 1, 2]
    for i in range(3):
        assert sum(len(d.token_ids) for d in deltas if d.index == i) == 4


def test_resize_cache_shrinks_and_grows(cluster: Cluster) -> None:
    control = pb_grpc.ControlStub(cluster.channel)
    before = stats(cluster)
    total = before.total_blocks
    try:
        resp = control.ResizeCache(pb.ResizeCacheRequest(num_blocks=total // 2), timeout=10)
        assert resp.usable_blocks == total // 2
        after = stats(cluster)
        assert after.usable_blocks == total // 2
        assert list(after.memory) == list(before.memory), "a shrink gives no worker memory back (docs/guide.md)"
        assert generate(pb_grpc.GenerationStub(cluster.channel), "still serving")[-1].finish_reason == "length"
        with pytest.raises(grpc.RpcError) as err:
            control.ResizeCache(pb.ResizeCacheRequest(num_blocks=total + 1), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:  # the shared world is left as it was found
        assert control.ResizeCache(pb.ResizeCacheRequest(num_blocks=total), timeout=10).usable_blocks == total


def test_client_stats_prints_every_field(cluster: Cluster) -> None:
    deadline = time.monotonic() + 10
    out = subprocess.run(
        [sys.executable, "-m", "clients.client", "stats", "--port", str(cluster.port)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=max(1.0, deadline - time.monotonic()),
    )
    assert out.returncode == 0, out.stderr
    for name in ("total_blocks", "kv_usage", "fragmentation", "prefix_cache_hit_rate", "preemptions_swap"):
        assert name in out.stdout
    device = next(p for p in stats(cluster).memory if p.tier == "device")
    assert f"used {device.used_bytes} of {device.allocated_bytes} bytes" in out.stdout


def test_memory_is_reported_in_bytes_per_tier_and_format(cluster: Cluster) -> None:
    generate(pb_grpc.GenerationStub(cluster.channel), SYSTEM + "fill some blocks")
    s = stats(cluster)
    pools = {p.tier: p for p in s.memory}
    assert set(pools) == {"device", "swap"}
    device, swap = pools["device"], pools["swap"]
    assert device.format == swap.format and device.format in ("float32", "bfloat16")
    assert device.bytes_per_block == swap.bytes_per_block > 0
    assert (device.total_blocks, device.used_blocks) == (s.total_blocks, s.used_blocks)
    assert (swap.total_blocks, swap.used_blocks) == (s.swap_blocks_total, s.swap_blocks_used)
    for pool, budget in ((device, SHARED.kv_cache_memory_bytes), (swap, int(SHARED.swap_space_gib * 2**30))):
        assert pool.allocated_bytes == pool.total_blocks * pool.bytes_per_block
        assert budget - pool.bytes_per_block < pool.allocated_bytes <= budget  # what the worker was told to hold
        assert pool.used_bytes == pool.used_blocks * pool.bytes_per_block
    assert device.hits == s.prefix_cache_hits and swap.hits == 0
