"""Clusters of the end-to-end tests: one shared world for every test that leaves it as it found it, and `serving`
for a module or test that needs a world of its own (other flags, or one it kills).

The shared world (tests/e2e/conftest.py: `shared_world` for the session, `shared_cluster` for a test) is one
scheduler and one worker on the tiny Llama with both doors, metrics, an API key and small queue bounds, started
once per session. A test on it must not kill, restart or reconfigure it (a ResizeCache is undone before the test
ends); each test gets it idle (nothing running or waiting, every block free) and must leave it so."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from minivllm.cluster import Cluster, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.support.ops import wait_idle

C = TypeVar("C", bound=Cluster)


class MeteredCluster(Cluster):
    """A cluster whose scheduler also serves Prometheus metrics, at `metrics_url`."""

    def __init__(
        self, model: Path, scheduler_args: Sequence[str] = (), worker_args: Sequence[str] = (), http: bool = False
    ) -> None:
        port = free_port()
        super().__init__(model, [*scheduler_args, "--metrics-port", str(port)], worker_args, http=http)
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"


@contextmanager
def serving(cluster: C, stop: bool = True) -> Iterator[C]:
    """`cluster` once it is SERVING. Afterwards it is stopped (SIGTERM) and every process must exit 0; with
    `stop=False` (a test killed or replaced processes itself) it is killed."""
    try:
        cluster.wait_serving()
        yield cluster
    finally:
        if stop:
            codes = cluster.stop()
        else:
            cluster.kill()
    if stop:
        assert codes == [0] * len(codes), f"unclean exit {codes}\n{cluster.logs()}"


@dataclass(frozen=True, slots=True)
class SharedWorldConfig:
    """What the shared world runs with; tests read their limits from here."""

    served_model_name: str = "tiny"
    api_key: str = "sk-test-key"
    max_num_seqs: int = 8  # further requests wait
    max_waiting_requests: int = 32  # further requests are refused (RESOURCE_EXHAUSTED, HTTP 429)
    kv_cache_memory_bytes: int = 16 * 2**20
    swap_space_gib: float = 0.01

    def scheduler_args(self) -> list[str]:
        return ["--served-model-name", self.served_model_name, "--api-key", self.api_key,
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-waiting-requests", str(self.max_waiting_requests)]  # fmt: skip

    def worker_args(self) -> list[str]:
        return ["--kv-cache-memory", str(self.kv_cache_memory_bytes), "--swap-space", str(self.swap_space_gib)]


SHARED = SharedWorldConfig()


@contextmanager
def shared_world(model: Path) -> Iterator[MeteredCluster]:
    with serving(MeteredCluster(model, SHARED.scheduler_args(), SHARED.worker_args(), http=True)) as cluster:
        yield cluster


def idle(cluster: Cluster, timeout: float = 60.0) -> None:
    """AssertionError when the world does not become idle (a test before left work behind)."""
    stats = wait_idle(pb_grpc.ControlStub(cluster.channel), timeout)
    assert (stats.num_running, stats.num_waiting, stats.free_blocks) == (0, 0, stats.total_blocks), (
        f"the shared world is not idle: {stats}"
    )


def control_stats(cluster: Cluster) -> pb.Stats:
    return pb_grpc.ControlStub(cluster.channel).GetStats(pb.GetStatsRequest(), timeout=5)
