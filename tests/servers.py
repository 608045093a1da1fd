"""Start a real scheduler and workers as subprocesses on free loopback ports, and stop them afterwards."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(
        self, model: Path, scheduler_args: list[str] = (), worker_args: list[str] = (), num_workers: int = 1
    ) -> None:  # type: ignore[assignment]
        self.port = free_port()
        self.worker_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
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
        codes = []
        for proc in [self.scheduler, *self.workers]:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(None)
        return codes


def stream_workload(channel: grpc.Channel, work: list[tuple[list[int], int]]) -> tuple[list[int], float]:
    """Send every (prompt ids, max_tokens) request at once, greedy with ignore_eos; return the tokens each
    got and the wall time (benchmarks)."""
    from proto import serving_pb2 as pb
    from proto import serving_pb2_grpc as pb_grpc

    stub = pb_grpc.GenerationStub(channel)
    counts = [0] * len(work)

    def one(i: int) -> None:
        prompt, out = work[i]
        req = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
        )
        counts[i] = sum(len(r.token_ids) for r in stub.Generate(req, timeout=3600))

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts, time.perf_counter() - start


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def alive(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")
