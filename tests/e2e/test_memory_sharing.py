"""`scheduling_policy.memory_sharing: enabled` end to end: two tiny-llama replicas publishing their KV events
behind a round-robin router with --memory-sharing. The first request of a prompt computes it on one replica; the
next of the same prefix goes (round robin) to the other, which pulls the prefix's blocks from the first instead of
recomputing them (its usage's cached tokens, on a cache that never saw the prompt), gives the first replica's own
greedy tokens, and leaves no block leased on either."""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm.cluster import Cluster, RouterProcess, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.e2e.test_router import LLAMA, LLAMA_WORKER, PROBE, metric
from tests.support.ops import greedy_ids, prompt_ids, wait_for

pytestmark = pytest.mark.e2e


def stats(c: Cluster) -> pb.Stats:
    return pb_grpc.ControlStub(c.channel).GetStats(pb.GetStatsRequest(), timeout=5)


def test_a_replica_pulls_the_prefix_its_peer_computed(tiny_llama_dir: Path) -> None:
    ports = [(free_port(), free_port()) for _ in range(2)]
    llamas = [
        Cluster(tiny_llama_dir, [*LLAMA, "--kv-events-port", str(e), "--kv-events-snapshot-port", str(s)], LLAMA_WORKER)
        for e, s in ports
    ]
    replicas = [
        f"{c.address},model=llama,kv_events=127.0.0.1:{e},kv_snapshot=127.0.0.1:{s},tokenizer={tiny_llama_dir}"
        for c, (e, s) in zip(llamas, ports)
    ]
    metrics_port = free_port()
    args = ["--routing-strategy", "round_robin", "--memory-sharing", "--metrics-port", str(metrics_port), *PROBE]
    router: RouterProcess | None = None
    try:
        for c in llamas:
            c.wait_serving()
        router = RouterProcess(replicas, args)
        router.wait_serving(30)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        stub = pb_grpc.GenerationStub(router.channel)
        shared = prompt_ids(777, 80)  # 5 blocks of 16
        first = list(stub.Generate(greedy_ids(shared + [5], 4, model="llama"), timeout=60))
        assert first[-1].usage.cached_tokens == 0 and stats(llamas[1]).prefix_cache_queries == 0
        wait_for(
            lambda: metric(url, "minivllm:router_kv_indexed_blocks", replica=llamas[0].address) >= 5,
            10,
            "the router indexes the blocks the first replica stored",
        )
        own = [
            t
            for r in pb_grpc.GenerationStub(llamas[0].channel).Generate(greedy_ids(shared + [6], 8))
            for t in r.token_ids
        ]
        responses = list(
            stub.Generate(greedy_ids(shared + [6], 8, model="llama"), timeout=60)
        )  # round robin: llamas[1]
        assert [t for r in responses for t in r.token_ids] == own
        assert responses[-1].usage.cached_tokens == 80, "5 blocks pulled from the peer, not recomputed"
        second = stats(llamas[1])
        assert (second.prefix_cache_queries, second.prefix_cache_hits) == (81, 80), "it ran on the other replica"
        wait_for(lambda: stats(llamas[0]).used_blocks == 0 == stats(llamas[1]).used_blocks, 30, "no block held")
    finally:
        if router is not None:
            router.stop()
        for c in llamas:
            c.kill()
