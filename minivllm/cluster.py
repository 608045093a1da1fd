"""A scheduler and its workers as processes on free loopback ports, for benchmarks and tests; a router in front of
several such clusters.

cluster = Cluster(model_folder, ["--max-num-seqs", "64"], ["--threads", "2"], http=True)
cluster.wait_serving()
stub = GenerationStub(cluster.channel)          # gRPC
openai.OpenAI(base_url=cluster.base_url, ...)   # and the OpenAI API
...
cluster.stop()
router = RouterProcess([f"{cluster.address},model={name}" for cluster, name in ...], ["--routing-strategy", "prefix"])
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import wait_ready
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.engine.ports import free_port

REPO = Path(__file__).resolve().parent.parent  # the processes run from the checkout


class Cluster:
    def __init__(
        self,
        model: Path,
        scheduler_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        num_workers: int = 1,
        port: int = 0,
        http: bool = False,
        http_port: int = 0,
    ) -> None:
        self.port = port or free_port()  # a given port: a scheduler that replaces one at the same address
        self.worker_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = (http_port or free_port()) if http else 0  # the OpenAI API, at self.base_url
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
        wait_serving(self.channel, [self.scheduler, *self.workers], timeout, self.logs)

    def kill(self) -> None:
        """Tear down without ceremony (tests that killed or replaced processes themselves); returns once they are
        gone, so a replacement may bind their ports."""
        for proc in [self.scheduler, *self.workers]:
            if proc.poll() is None:
                proc.kill()
        for proc in [self.scheduler, *self.workers]:
            proc.wait(30)

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


class ServeProcess:
    """`vllm-serve` on free loopback ports, its log in a file; everything else at its defaults."""

    def __init__(self, model: Path, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.log = log_dir / "serve.log"
        argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(model), "--grpc-port", str(self.port),
                "--worker-port", str(free_port()), "--openai-port", "0", *extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.control = pb_grpc.ControlStub(self.channel)

    def wait_serving(self, timeout: float = 300.0) -> None:
        if not wait_ready(self.channel, timeout):
            raise TimeoutError(f"vllm-serve not SERVING after {timeout} s\n{self.tail()}")

    def workers(self) -> list[pb.WorkerStatus]:
        return list(self.control.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers)

    def ready_pids(self) -> list[int]:
        return [w.pid for w in self.workers() if w.state == "ready"]

    def stats(self) -> pb.Stats:
        return self.control.GetStats(pb.GetStatsRequest(), timeout=10)

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text()[-chars:]

    def stop(self) -> int | None:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


class RouterProcess:
    """A vllm-router on a free loopback port in front of `replicas` (HOST:PORT,model=NAME each); with `http`, its
    OpenAI API at self.base_url."""

    def __init__(self, replicas: Sequence[str], router_args: Sequence[str] = (), http: bool = False) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port() if http else 0
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1" if http else ""
        self.log = Path(subprocess.check_output(["mktemp"], text=True).strip())
        argv = [sys.executable, "-m", "router_node.main", "--port", str(self.port), "--log-level", "INFO",
                "--openai-port", str(self.http_port)]  # fmt: skip
        for replica in replicas:
            argv += ["--replica", replica]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([*argv, *router_args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.address)

    def logs(self) -> str:
        return f"--- router\n{self.log.read_text()[-4000:]}"

    def wait_serving(self, timeout: float = 120.0) -> None:
        wait_serving(self.channel, [self.process], timeout, self.logs)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (it drains its open streams); the exit code."""
        self.channel.close()
        self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def wait_serving(
    channel: grpc.Channel, processes: Sequence[subprocess.Popen], timeout: float, logs: Callable[[], str]
) -> None:
    """Until grpc.health.v1 says SERVING; RuntimeError when one of `processes` exits first."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in processes:
            if proc.poll() is not None:
                raise RuntimeError(f"a process exited with {proc.returncode}\n{logs()}")
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not SERVING after {timeout} s\n{logs()}")
