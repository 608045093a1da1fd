"""vllm-serve starts a scheduler and its workers, serves, and stops them all cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from minivllm.cluster import REPO, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.cli.client import wait_ready
from tests.ops import Streams, alive, child_pids, greedy_ids, prompt_ids, wait_for


def assert_stops_with_its_children(serve: subprocess.Popen, sig: int, expected_children: int) -> None:
    children = child_pids(serve.pid)
    assert len(children) == expected_children, children
    serve.send_signal(sig)
    assert serve.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "children outlived vllm-serve"


def test_serve_runs_and_stops_all_children_on_sigterm(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port, worker_port = free_port(), free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tiny_llama_dir}\nkv-cache-memory: 16MiB\nthreads: 1\nlog-level: WARNING\n")
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--config", str(config),
            "--port", str(port), "--worker-port", str(worker_port)]  # fmt: skip
    serve = subprocess.Popen(argv, cwd=REPO)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert wait_ready(channel, 120), "vllm-serve never became SERVING"
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=5, temperature=0))
            deltas = list(stub.Generate(request, timeout=60))
            assert deltas[-1].usage.completion_tokens == 5
        assert_stops_with_its_children(serve, signal.SIGTERM, 2)  # the scheduler and one worker
    finally:
        if serve.poll() is None:
            serve.kill()


def test_serve_data_parallel_replicas_behind_a_router_balance_and_stop_on_ctrl_c(tiny_llama_dir: Path) -> None:
    port, worker_port = free_port(), free_port()
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(tiny_llama_dir), "--data-parallel-size",
            "2", "--routing-strategy", "least_loaded", "--kv-cache-memory", "16MiB", "--threads", "1", "--log-level",
            "WARNING", "--port", str(port), "--worker-port", str(worker_port)]  # fmt: skip
    serve = subprocess.Popen(argv, cwd=REPO)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert wait_ready(channel, 120), "the router never became SERVING"
            control = pb_grpc.ControlStub(channel)

            def replicas() -> list[pb.ReplicaStatus]:
                return list(control.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas)

            wait_for(lambda: [r.state for r in replicas()] == ["serving", "serving"], 120, "both replicas serving")
            assert {r.model for r in replicas()} == {tiny_llama_dir.name}
            requests = [greedy_ids(prompt_ids(i), 16) for i in range(40)]
            results = Streams(pb_grpc.GenerationStub(channel), requests).join(120)
            assert all(r.finish_reason == "length" and len(r.tokens) == 16 for r in results)
            counts = [r.requests for r in replicas()]
            assert sum(counts) == 40 and all(abs(c - 20) <= 0.2 * 20 for c in counts), counts  # within 20 %
        assert_stops_with_its_children(serve, signal.SIGINT, 5)  # the router, two schedulers, a worker each
    finally:
        if serve.poll() is None:
            serve.kill()
