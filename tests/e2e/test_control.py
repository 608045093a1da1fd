"""Control.ListWorkers and Drain, SIGTERM draining, overload (RESOURCE_EXHAUSTED), deadlines, and a storm of
1,000 requests with cancels and aborts that leaves no block, task or socket behind. Real processes, tiny model."""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import socket
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest

from minivllm.cluster import Cluster
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.cli.scheduler import build_parser as scheduler_parser
from settings.config_file import parse_args
from tests.support.clusters import SHARED, MeteredCluster
from tests.support.ops import (
    NOT_SERVING,
    SERVING,
    TINY_WORKER,
    Streams,
    greedy_ids,
    health_status,
    list_workers,
    prompt_ids,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.e2e

MAX_SEQS, MAX_WAITING = SHARED.max_num_seqs, SHARED.max_waiting_requests
DRAIN_TIMEOUT = 1.0


@pytest.fixture
def cluster(shared_cluster: MeteredCluster) -> MeteredCluster:
    return shared_cluster  # the shared world (tests/support/clusters.py)


@pytest.fixture
def stub(cluster: MeteredCluster) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(cluster.channel)


@pytest.fixture
def control(cluster: MeteredCluster) -> pb_grpc.ControlStub:
    return pb_grpc.ControlStub(cluster.channel)


def test_new_flags_have_config_keys(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "heartbeat-timeout: 3\nworker_rejoin_timeout: 7\ndrain-timeout: 9\nmax-waiting-requests: 11\n"
        "metrics-port: 9100\ncontrol-token: s3cret\nzmq-curve-dir: /tmp/k\ntls-cert: c.pem\ntls-key: k.pem\n"
    )
    a = parse_args(scheduler_parser(), ["--config", str(config)])
    assert (a.heartbeat_timeout, a.worker_rejoin_timeout, a.shutdown_timeout, a.max_waiting_requests) == (3, 7, 9, 11)
    assert (a.metrics_port, a.control_token, a.zmq_curve_dir, a.tls_cert, a.tls_key) == (
        9100, "s3cret", "/tmp/k", "c.pem", "k.pem")  # fmt: skip


def test_list_workers_describes_every_rank(cluster: MeteredCluster, control: pb_grpc.ControlStub) -> None:
    (w,) = list_workers(cluster)
    stats = control.GetStats(pb.GetStatsRequest(), timeout=5)
    assert (w.rank, w.tp_rank, w.pp_stage, w.state) == (0, 0, 0, "ready")
    assert (w.pid, w.host, w.device) == (cluster.workers[0].pid, socket.gethostname(), "cpu")
    assert w.num_kv_blocks >= stats.total_blocks > 0
    assert 0 <= w.heartbeat_age_s < 10
    assert health_status(cluster.channel) == SERVING


def test_full_waiting_queue_is_refused_at_once(stub, control) -> None:  # type: ignore[no-untyped-def]
    def counts() -> tuple[int, int]:
        s = control.GetStats(pb.GetStatsRequest(), timeout=5)
        return s.num_running, s.num_waiting

    calls = [stub.Generate(greedy_ids(prompt_ids(i), 900), timeout=60) for i in range(MAX_SEQS)]
    try:
        wait_for(lambda: counts() == (MAX_SEQS, 0), 30, "--max-num-seqs running")
        calls += [stub.Generate(greedy_ids(prompt_ids(i), 900), timeout=60) for i in range(MAX_WAITING)]
        wait_for(lambda: counts() == (MAX_SEQS, MAX_WAITING), 30, "running and waiting at their limits")
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(greedy_ids(prompt_ids(99), 2), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert time.monotonic() - start < 2, "refused, but not at once"
    finally:
        for call in calls:
            call.cancel()
    stats = wait_idle(control)
    assert (stats.num_running, stats.num_waiting, stats.free_blocks) == (0, 0, stats.total_blocks)


def test_deadline_s_ends_the_request_and_frees_its_blocks(stub, control) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    deltas = []
    with pytest.raises(grpc.RpcError) as err:
        for d in stub.Generate(greedy_ids(prompt_ids(5), 1000, deadline_s=0.3), timeout=60):
            deltas.append(d)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert err.value.details().startswith("deadline_s:")
    assert time.monotonic() - start < 5
    assert sum(len(d.token_ids) for d in deltas) < 1000
    stats = wait_idle(control)
    assert stats.free_blocks == stats.total_blocks


def test_grpc_deadline_ends_the_request_and_frees_its_blocks(stub, control) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(greedy_ids(prompt_ids(6), 1000), timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_idle(control)
    assert (stats.num_running, stats.free_blocks) == (0, stats.total_blocks)


@pytest.mark.parametrize("deadline", [-1.0, math.nan, math.inf])
def test_bad_deadline_is_invalid_argument(stub, deadline: float) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(greedy_ids(prompt_ids(7), 2, deadline_s=deadline), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("deadline_s:")


def _scrape(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_1000_requests_with_random_cancels_and_aborts_leave_nothing_behind(cluster: MeteredCluster, control) -> None:  # type: ignore[no-untyped-def]
    url = cluster.metrics_url
    pid = cluster.scheduler.pid
    wait_idle(control)
    tasks_before = _scrape(url, "minivllm:asyncio_tasks")
    fds_before = len(os.listdir(f"/proc/{pid}/fd"))
    outcomes = asyncio.run(_storm(cluster.address, 1000))
    assert sum(outcomes.values()) == 1000
    assert outcomes["length"] > 100 and outcomes["CANCELLED"] > 100 and outcomes["abort"] > 10, outcomes
    assert not set(outcomes) - {"length", "abort", "CANCELLED"}, outcomes
    stats = wait_idle(control)
    assert (stats.num_running, stats.num_waiting, stats.free_blocks) == (0, 0, stats.total_blocks)
    wait_for(lambda: _scrape(url, "minivllm:asyncio_tasks") <= tasks_before, 10, "no leaked asyncio tasks")
    wait_for(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= fds_before + 2, 10, "no leaked sockets")


async def _storm(address: str, n: int) -> Counter[str]:
    rng = random.Random(1234)
    outcomes: Counter[str] = Counter()
    limit = asyncio.Semaphore(12)  # well below --max-waiting-requests, even while cancels are in flight
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            mode, early = rng.choice(["finish", "cancel", "abort"]), rng.random() < 0.5
            request = greedy_ids(prompt_ids(i, rng.randint(1, 12)), rng.randint(2, 4), request_id=f"storm-{i}")
            async with limit:
                call = stub.Generate(request, timeout=60)
                try:
                    if mode == "cancel":
                        if not early:
                            await call.read()
                        call.cancel()
                        outcomes["CANCELLED"] += 1
                        return
                    if mode == "abort":
                        if not early:
                            await call.read()
                        await stub.Abort(pb.AbortRequest(request_id=request.request_id), timeout=10)
                    while (delta := await call.read()) is not grpc.aio.EOF:  # read(): no mixing with async for
                        if delta.finish_reason:
                            outcomes[delta.finish_reason] += 1
                except grpc.aio.AioRpcError as exc:
                    outcomes[exc.code().name] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(tiny_llama_dir: Path) -> None:
    """A world of its own: the test stops it."""
    cluster = Cluster(tiny_llama_dir, ["--drain-timeout", str(DRAIN_TIMEOUT)], TINY_WORKER)
    try:
        cluster.wait_serving()
        stub = pb_grpc.GenerationStub(cluster.channel)
        short = [greedy_ids(prompt_ids(40 + i), 24) for i in range(3)]
        endless = greedy_ids(prompt_ids(50), 1000)  # cannot finish within --drain-timeout
        streams = Streams(stub, [*short, endless])
        streams.wait_all_started()
        cluster.scheduler.send_signal(signal.SIGTERM)
        wait_for(lambda: health_status(cluster.channel) in (NOT_SERVING, -1), 5, "NOT_SERVING while draining")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(greedy_ids(prompt_ids(51), 2), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        results = streams.join(DRAIN_TIMEOUT + 20)
        for r in results[:3]:
            assert (r.code, r.finish_reason, len(r.tokens)) == (None, "length", 24), r.details
        assert results[3].code == grpc.StatusCode.UNAVAILABLE and len(results[3].tokens) < 1000
        codes = [p.wait(DRAIN_TIMEOUT + 20) for p in [cluster.scheduler, *cluster.workers]]
        assert codes == [0, 0], cluster.logs()
    finally:
        cluster.kill()


def test_drain_rpc_finishes_running_refuses_new_then_sigterm_exits_0(tiny_llama_dir: Path) -> None:
    c = Cluster(tiny_llama_dir, ["--drain-timeout", "30"], TINY_WORKER)
    try:
        c.wait_serving()
        stub, control = pb_grpc.GenerationStub(c.channel), pb_grpc.ControlStub(c.channel)
        streams = Streams(stub, [greedy_ids(prompt_ids(60 + i), 80) for i in range(4)])
        streams.wait_all_started()
        answer: list[pb.DrainResponse] = []
        drain = threading.Thread(target=lambda: answer.append(control.Drain(pb.DrainRequest(), timeout=60)))
        drain.start()
        wait_for(lambda: health_status(c.channel) == NOT_SERVING, 5, "NOT_SERVING while draining")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(greedy_ids(prompt_ids(61), 2), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.value.details()
        for r in streams.join():
            assert (r.code, r.finish_reason, len(r.tokens)) == (None, "length", 80), r.details
        drain.join(30)
        assert answer and (answer[0].drained, answer[0].remaining) == (True, 0)
        assert control.Drain(pb.DrainRequest(timeout_s=1), timeout=5).drained  # idempotent
    finally:
        codes = c.stop()
    assert codes == [0, 0], c.logs()
