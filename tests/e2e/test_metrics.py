"""The Prometheus endpoint is scraped while a real server works: vLLM's series are there and they move;
vllm-monitor prints them."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm.cluster import REPO
from proto import serving_pb2_grpc as pb_grpc
from tests.support.clusters import MeteredCluster, serving
from tests.support.ops import Streams, greedy_ids, prompt_ids, wait_for

pytestmark = pytest.mark.e2e

COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"]  # fmt: skip
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:iteration_tokens_total",
              "minivllm:scheduler_step_seconds", "minivllm:engine_step_seconds"]  # fmt: skip
ALLOCATED_BYTES = "minivllm:kv_cache_allocated_bytes{format=float32,tier=device}"
USED_BYTES = "minivllm:kv_cache_used_bytes{format=float32,tier=device}"
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "minivllm:kv_fragmentation", "minivllm:batch_utilization"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[MeteredCluster]:
    """A world of its own: 32 blocks of 16 tokens in float32 (`auto` would be bf16 on some CPUs: twice the blocks),
    so that four 150-token requests do not fit at once and some are preempted."""
    args = ["--max-num-batched-tokens", "64", "--dtype", "float32"]
    with serving(MeteredCluster(tiny_llama_dir, args, ["--kv-cache-memory", "256KiB"])) as c:
        yield c


def scrape(url: str) -> dict[str, float]:
    """Sample name (plus labels other than model_name) -> value."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_named_series_are_present_and_move(cluster: MeteredCluster) -> None:
    url = cluster.metrics_url
    before = scrape(url)
    for name in GAUGES:
        assert name in before, name
    stub = pb_grpc.GenerationStub(cluster.channel)
    shared = prompt_ids(1, 40)  # two full blocks: the second request finds them in the prefix cache
    streams = Streams(stub, [greedy_ids(prompt_ids(10 + i), 150) for i in range(4)])
    busy: list[dict[str, float]] = []

    def running() -> bool:
        busy.append(scrape(url))
        return busy[-1]["vllm:num_requests_running"] > 0

    wait_for(running, 30, "running > 0")
    assert busy[-1]["vllm:kv_cache_usage_perc"] > 0 and 0 <= busy[-1]["minivllm:kv_fragmentation"] < 1
    assert 0 < busy[-1][USED_BYTES] <= busy[-1][ALLOCATED_BYTES] <= 256 * 1024  # --kv-cache-memory
    for r in streams.join():
        assert r.finish_reason == "length", r.details
    for _ in range(2):
        assert list(stub.Generate(greedy_ids(shared, 3), timeout=30))[-1].finish_reason == "length"
    wait_for(lambda: scrape(url)["vllm:num_requests_running"] == 0, 10, "running back to 0")
    after = scrape(url)
    for name in COUNTERS:
        key = name + "_total" + ("{finished_reason=length}" if name == "vllm:request_success" else "")
        assert after[key] > before.get(key, 0), key
    for name in HISTOGRAMS:
        assert after[name + "_count"] > before[name + "_count"], name
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4 * 150 + 2 * 3
    assert after["minivllm:batch_utilization"] > 0
    assert after["minivllm:workers_ready"] == 1 and after["process_open_fds"] > 0
    hits, queries = after["vllm:prefix_cache_hits_total"], after["vllm:prefix_cache_queries_total"]
    assert after["minivllm:cache_hit_rate{tier=device}"] == pytest.approx(hits / queries) and hits > 0
    assert after[USED_BYTES] == 0 and after[ALLOCATED_BYTES] == busy[-1][ALLOCATED_BYTES]


def test_vllm_monitor_prints_live_values(cluster: MeteredCluster) -> None:
    url = cluster.metrics_url
    argv = [sys.executable, "-m", "clients.monitor", "--url", url, "--interval", "0.1", "--count", "2",
            "--metric", "vllm:num_requests_running", "--metric", "vllm:generation_tokens_total",
            "--metric", "vllm:e2e_request_latency_seconds"]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 6, lines  # three metrics, two scrapes
    assert any("vllm:num_requests_running" in line and line.endswith(" 0") for line in lines)
    assert any("vllm:generation_tokens_total" in line and "/s)" in line for line in lines)
    assert any("vllm:e2e_request_latency_seconds" in line and "count=" in line for line in lines)
    missing = subprocess.run([*argv[:5], "--count", "1", "--metric", "vllm:nope"], cwd=REPO, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
    assert missing.returncode == 2 and "vllm:nope" in missing.stderr


def test_vllm_monitor_short_names(cluster: MeteredCluster) -> None:
    """`--metric cache_hit_rate` and `--metric memory_usage`, as the seed asks: per tier (and format)."""
    url = cluster.metrics_url
    argv = [sys.executable, "-m", "clients.monitor", "--url", url, "--count", "1",
            "--metric", "cache_hit_rate", "--metric", "memory_usage"]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any('minivllm:cache_hit_rate{model_name="' in line and 'tier="device"' in line for line in lines), lines
    for series in ("kv_cache_used_bytes", "kv_cache_allocated_bytes"):
        pools = [line for line in lines if f"minivllm:{series}" in line]
        assert {'tier="device"' in line for line in pools} == {True, False}, lines  # device and swap
        assert all('format="float32"' in line and line.endswith(" GiB)") for line in pools), lines


def test_vllm_monitor_has_help_and_config() -> None:
    out = subprocess.run([sys.executable, "-m", "clients.monitor", "--help"], cwd=REPO, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0 and "--config" in out.stdout and "--interval" in out.stdout
