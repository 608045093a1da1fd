"""Article 003's multi-node lines, as written (host addresses on loopback): `vllm-scheduler --host H --port 50051`
with no model, then each worker `vllm-worker --model M --scheduler-address H:50051 --tensor-parallel-size T
--pipeline-parallel-size P` at the scheduler's gRPC address. The scheduler serves the workers' model and shape;
a worker that disagrees is refused by name and exits with the bad-flags status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO, free_port, wait_serving
from proto import serving_pb2_grpc as pb_grpc
from settings.worker import EXIT_BAD_FLAGS
from tests.support.ops import greedy_ids

pytestmark = pytest.mark.e2e

# The article has TP 2 x PP 2 on four nodes; one stage split in two keeps it to two CPU processes here.
SHAPE = ["--tensor-parallel-size", "1", "--pipeline-parallel-size", "2"]


def test_a_scheduler_without_a_model_serves_what_its_workers_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import grpc

    port = free_port()
    scheduler_argv = ["scheduler_node.cli.scheduler", "--host", "127.0.0.1", "--port", str(port)]
    scheduler_argv += ["--worker-port", str(free_port())]  # not 50061: the machine may run another one
    worker_argv = ["worker_node.worker", "--model", str(tiny_llama_dir), "--scheduler-address", f"127.0.0.1:{port}"]
    worker_argv += [*SHAPE, "--threads", "1", "--kv-cache-memory", "16MiB"]
    logs = {name: tmp_path / f"{name}.log" for name in ("scheduler", "worker0", "worker1", "stranger")}
    procs = {"scheduler": _spawn(scheduler_argv, logs["scheduler"])}
    procs |= {name: _spawn(worker_argv, logs[name]) for name in ("worker0", "worker1")}
    text = lambda: "\n".join(f"--- {n}\n{p.read_text()[-3000:]}" for n, p in logs.items() if p.exists())  # noqa: E731
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        wait_serving(channel, list(procs.values()), 180.0, text)
        responses = list(pb_grpc.GenerationStub(channel).Generate(greedy_ids([1, 2, 3, 4], 4), timeout=60))
        assert sum(len(r.token_ids) for r in responses) == 4, text()
        assert "as the first worker" in logs["scheduler"].read_text()

        # Another model, another shape: refused by name, and it exits with the status a supervisor does not retry.
        stranger = ["worker_node.worker", "--model", str(tmp_path / "another-model"), "--scheduler-address"]
        stranger += [f"127.0.0.1:{port}", "--tensor-parallel-size", "2", "--threads", "1"]
        refused = _spawn(stranger, logs["stranger"])
        assert refused.wait(120) == EXIT_BAD_FLAGS, text()
        said = logs["stranger"].read_text()
        assert f"--model {tmp_path / 'another-model'} (the world serves {tiny_llama_dir.resolve()})" in said, said
        assert "--tensor-parallel-size 2 (the world's is 1)" in said and "--pipeline-parallel-size 1" in said, said
        assert procs["scheduler"].poll() is None  # the world goes on
    finally:
        channel.close()
        procs["scheduler"].terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", *argv, "--log-level", "INFO"], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
