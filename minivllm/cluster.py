"""A scheduler and its workers as processes on free loopback ports, for benchmarks and tests.

cluster = Cluster(model_folder, ["--max-num-seqs", "64"], ["--threads", "2"], http=True)
cluster.wait_serving()
stub = GenerationStub(cluster.channel)          # gRPC
openai.OpenAI(base_url=cluster.base_url, ...)   # and the OpenAI API
...
cluster.stop()
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent  # the processes run from the checkout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(
        self,
        model: Path,
        scheduler_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        num_workers: int = 1,
        http: bool = False,
    ) -> None:
        self.port = free_port()
        self.worker_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port() if http else 0  # the OpenAI API, at self.base_url
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1" if http else ""
        self.log_dir = Path(subprocess.check_output(["mktemp", "-d"], text=True).strip())
        common = ["--log-level", "INFO"]
        self.scheduler = self._spawn(
            "scheduler",
            [
                sys.executable,
                "-m",
                "scheduler_node.cli.scheduler",
                "--model",
                str(model),
                "--port",
                str(self.port),
                "--worker-port",
                str(self.worker_port),
                "--num-workers",
                str(num_workers),
                "--openai-port",
                str(self.http_port),
                *common,
                *scheduler_args,
            ],
        )
        self.workers = [
            self._spawn(
                f"worker{i}",
                [
                    sys.executable,
                    "-m",
                    "worker_node.worker",
                    "--scheduler-address",
                    f"127.0.0.1:{self.worker_port}",
                    "--threads",
                    "1",
                    *common,
                    *worker_args,
                ],
            )
            for i in range(num_workers)
        ]
        self.channel = grpc.insecure_channel(self.address)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def wait_serving(self, timeout: float = 120.0) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in [self.scheduler, *self.workers]:
                if proc.poll() is not None:
                    raise RuntimeError(f"a process exited with {proc.returncode}\n{self.logs()}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not SERVING after {timeout} s\n{self.logs()}")

    def kill(self) -> None:
        """Tear down without ceremony (tests that killed or replaced processes themselves)."""
        for proc in [self.scheduler, *self.workers]:
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout: float = 20.0) -> list[int | None]:
        """SIGTERM the scheduler (it shuts the workers down); return every exit code."""
        self.channel.close()
        self.scheduler.terminate()
        codes: list[int | None] = []
        for proc in [self.scheduler, *self.workers]:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(None)
        return codes
