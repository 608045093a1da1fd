"""The disk KV tier through real processes: a worker process offloads over ZeroMQ plans, and a new scheduler and
worker over the same folder (a restart), or a replacement worker after the first was killed (a world restart),
answer the first request's prefix from the disk tier."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from minivllm.cluster import Cluster
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.support.ops import add_worker, rank0, wait_for

pytestmark = pytest.mark.e2e

PREFIX = 48  # three full blocks of 16


def ask(cluster: Cluster, ids: list[int]) -> list[int]:
    stub = pb_grpc.GenerationStub(cluster.channel)
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling)
    return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]


def start(model: Path, disk: Path) -> Cluster:
    cluster = Cluster(
        model,
        ["--block-size", "16", "--num-kv-blocks", "12"],
        ["--swap-space", "0.01", "--kv-offload-disk", str(disk), "--kv-offload-disk-size", "0.02"],
    )
    cluster.wait_serving()
    return cluster


def test_a_restarted_server_hits_the_disk_tier_from_its_first_request(tiny_llama_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(3, 49152) for _ in range(PREFIX)]
    question = [rng.randrange(3, 49152) for _ in range(5)]
    cluster = start(tiny_llama_dir, tmp_path)
    try:
        before = ask(cluster, prefix + question)
        for _ in range(3):  # unrelated prompts that take the whole device pool: the prefix goes to disk
            ask(cluster, [rng.randrange(3, 49152) for _ in range(64)])
    finally:
        cluster.stop()
    cluster = start(tiny_llama_dir, tmp_path)
    try:
        after = ask(cluster, prefix + question)
        stats = pb_grpc.ControlStub(cluster.channel).GetStats(pb.GetStatsRequest(), timeout=5)
    finally:
        cluster.stop()
    assert stats.prefix_cache_hits == PREFIX, "a fresh server's first request found its prefix on disk"
    assert after == before


def test_a_replacement_worker_brings_the_disk_tier_back(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A world restart (the worker killed, a replacement joins): the replacement re-opens the disk file and the
    scheduler offers its intact blocks again (a RAM tier's blocks die with the worker)."""
    rng = random.Random(6)
    prefix = [rng.randrange(3, 49152) for _ in range(PREFIX)]
    question = [rng.randrange(3, 49152) for _ in range(5)]
    worker = ["--swap-space", "0.01", "--kv-offload-disk", str(tmp_path), "--kv-offload-disk-size", "0.02"]
    cluster = Cluster(tiny_llama_dir, ["--block-size", "16", "--num-kv-blocks", "12"], worker)
    control = pb_grpc.ControlStub(cluster.channel)
    try:
        cluster.wait_serving()
        before = ask(cluster, prefix + question)
        for _ in range(3):  # unrelated prompts that take the whole device pool: the prefix goes to disk
            ask(cluster, [rng.randrange(3, 49152) for _ in range(64)])
        victim = cluster.workers[0]
        victim.kill()
        victim.wait(10)
        wait_for(lambda: rank0(cluster).state == "lost", 10, "rank 0 reported lost")
        hits = control.GetStats(pb.GetStatsRequest(), timeout=5).prefix_cache_hits
        add_worker(cluster, "replacement", worker)
        replacement = cluster.workers[-1].pid
        wait_for(lambda: (rank0(cluster).state, rank0(cluster).pid) == ("ready", replacement), 120, "replaced")
        after = ask(cluster, prefix + question)
        stats = control.GetStats(pb.GetStatsRequest(), timeout=5)
    finally:
        cluster.kill()
    assert stats.prefix_cache_hits - hits == PREFIX, "the replacement's first request found its prefix on disk"
    assert after == before
