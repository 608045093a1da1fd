"""Tensor and pipeline parallelism with real worker processes over gloo.

Each world serves a mixed concurrent batch through gRPC (prompts inside, at and across block boundaries,
chunked prefill) and must give the same greedy tokens as one in-process worker, each of them HF's argmax
given the same prefix. Pipeline worlds run with P plans in flight on disjoint requests, their ranks taking the
sampled tokens from the plans (tests/scheduler_node/core/test_pipeline.py checks that the stages overlap). The
multi-host world puts
its ranks on 127.0.0.2 and 127.0.0.3 by a topology file, then loses its scheduler and must exit instead of
hanging.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from clients.client import wait_ready
from minivllm.cluster import REPO, free_port
from minivllm.tiny_models import build_tiny_model
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.support.engine import generate, load_runner
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.ops import Streams, greedy_ids, wait_for
from worker_node.kv.cache import bytes_per_block
from worker_node.models.config import ModelConfig

pytestmark = pytest.mark.e2e

PROMPT_LENGTHS = [1, 7, 16, 17, 40, 70]
MAX_TOKENS = [14, 9, 12, 5, 16, 8]
# Chunked prefill; float32 because the outputs are compared with HF and one in-process worker at 1e-3 (`auto`
# is bf16 on CPUs with AVX-512 BF16).
SCHEDULER_ARGS = ["--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--dtype", "float32"]
WORKER_ARGS = ["--threads", "1", "--kv-cache-memory", "4MiB", "--swap-space", "0", "--connect-timeout", "20"]


class World:
    """A scheduler and its workers as subprocesses; every worker gets its own extra arguments."""

    def __init__(self, model: Path, scheduler_args: list[str], worker_args: list[list[str]], log_dir: Path) -> None:
        self.port, self.worker_port = free_port(), free_port()
        self.log_dir = log_dir
        self.scheduler = self._spawn(
            "scheduler",
            ["scheduler_node.cli.scheduler", "--model", str(model), "--port", str(self.port)]
            + ["--worker-port", str(self.worker_port), *SCHEDULER_ARGS, *scheduler_args],
        )
        address = f"127.0.0.1:{self.worker_port}"
        self.workers = [
            self._spawn(f"worker{i}", ["worker_node.worker", "--scheduler-address", address, *WORKER_ARGS, *extra])
            for i, extra in enumerate(worker_args)
        ]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        return subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def wait_serving(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p for p in [self.scheduler, *self.workers] if p.poll() is not None]
            assert not dead, f"a process exited with {dead[0].returncode}\n{self.logs()}"
            if wait_ready(self.channel, 1.0):
                return
        raise TimeoutError(f"not SERVING after {timeout} s\n{self.logs()}")

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """All prompts at once (one stream each), greedy; the token ids of each."""
        requests = [greedy_ids(p, m) for p, m in zip(prompts, max_tokens)]
        results = Streams(pb_grpc.GenerationStub(self.channel), requests).join(300)
        failed = [r for r in results if r.code is not None]
        assert not failed, f"{failed[0].code}: {failed[0].details}"
        return [r.tokens for r in results]

    def wait_all(self, timeout: float) -> list[int | None]:
        codes: list[int | None] = []
        deadline = time.monotonic() + timeout
        for p in [self.scheduler, *self.workers]:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def kill_all(self) -> None:
        self.channel.close()
        for p in [self.scheduler, *self.workers]:
            if p.poll() is None:
                p.kill()
                p.wait()


def workload(seed: int = 11, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def check_outputs(folder: Path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Same tokens as one worker, and each of them HF's greedy choice."""
    single, _ = generate(folder, load_runner(folder, 64, 16), prompts, MAX_TOKENS, max_num_batched_tokens=32)
    hf = load_hf(folder)
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, single)):
        assert len(out) == MAX_TOKENS[i], (i, out)
        assert_teacher_forced(hf, prompt, out)
        assert out == ref, f"prompt {i}: parallel {out} != one worker {ref}"


@pytest.fixture(scope="module")
def tiny_one_kv_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """4 query heads sharing 1 KV head: with TP 2 each rank holds a replica of it."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-1kv"), smollm2_dir, num_kv_heads=1)


@pytest.mark.parametrize(
    ("kind", "tp", "pp"),
    [("qwen2", 2, 1), ("llama", 1, 2)],  # qwen2: q/k/v biases sliced by head; llama: 1 layer per stage
    ids=["tp2-qwen2", "pp2-llama"],
)
def test_parallel_matches_one_worker_and_hf(
    kind: str, tp: int, pp: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    folder = request.getfixturevalue(f"tiny_{kind}_dir")
    args = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    world = World(folder, args, [[] for _ in range(tp * pp)], tmp_path)
    try:
        world.wait_serving()
        prompts = workload()
        outputs = world.generate(prompts, MAX_TOKENS)
        stats = pb_grpc.ControlStub(world.channel).GetStats(pb.GetStatsRequest(), timeout=10)
        world.channel.close()
        world.scheduler.terminate()
        codes = world.wait_all(30)
        assert codes == [0] * (1 + tp * pp), f"unclean exit {codes}\n{world.logs()}"
    finally:
        world.kill_all()
    check_outputs(folder, prompts, outputs)
    device = next(pool for pool in stats.memory if pool.tier == "device")
    whole = bytes_per_block(ModelConfig.from_folder(folder), stats.block_size, getattr(torch, device.format))
    assert device.bytes_per_block == whole, "memory stats sum every rank's shard of a block"


def test_multi_host_world_by_topology_then_scheduler_killed(tiny_one_kv_dir: Path, tmp_path: Path) -> None:
    topology = tmp_path / "two-hosts.yaml"
    topology.write_text(
        "device: cpu\ngroups:\n"
        "  - {host: 127.0.0.2, interconnect: loopback, device_ids: [0, 1]}\n"
        "  - {host: 127.0.0.3, interconnect: loopback, device_ids: [0, 1]}\n"
    )
    args = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--topology", str(topology)]
    args += ["--heartbeat-timeout", "3"]  # the workers give up on a silent scheduler after this
    # The second host's workers start first: they must still get the ranks of stage 1.
    hosts = ["127.0.0.3", "127.0.0.3", "127.0.0.2", "127.0.0.2"]
    world = World(tiny_one_kv_dir, args, [["--local-address", h] for h in hosts], tmp_path)
    try:
        world.wait_serving()
        prompts = workload(seed=12)
        outputs = world.generate(prompts, MAX_TOKENS)
        for i, host in enumerate(hosts):
            ranks = (0, 1) if host == "127.0.0.2" else (2, 3)
            log = world.log(f"worker{i}")
            assert any(f"rank {r} of 4" in log for r in ranks), f"worker on {host} got a wrong rank\n{log}"
            assert "joining the rendezvous at 127.0.0.2:" in log, log

        streaming = Streams(pb_grpc.GenerationStub(world.channel), [greedy_ids(prompts[-1], 400)])
        # mid-generation: some ranks may sit in a collective when the scheduler dies
        wait_for(lambda: len(streaming.results[0].tokens) >= 8, 60, "decoding under way")
        world.scheduler.kill()
        killed = time.monotonic()
        codes = world.wait_all(45)
        streaming.join(30)
        assert codes[1:] == [0] * len(hosts), f"workers did not exit cleanly: {codes}\n{world.logs()}"
        assert time.monotonic() - killed < 30
        for i in range(len(hosts)):
            assert "Traceback" not in world.log(f"worker{i}"), world.logs()
    finally:
        world.kill_all()
    check_outputs(tiny_one_kv_dir, prompts, outputs)


def test_incomplete_world_times_out_naming_the_missing_rank(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """One worker of a TP 2 world: the scheduler gives up naming rank 1, and the worker waiting at the
    rendezvous leaves at once instead of waiting out the distributed timeout."""
    args = ["--tensor-parallel-size", "2", "--worker-join-timeout", "4"]
    world = World(tiny_llama_dir, args, [[]], tmp_path)
    try:
        codes = world.wait_all(40)
        assert codes == [2, 0], f"{codes}\n{world.logs()}"
        text = world.log("scheduler")
        assert "ranks [1] did not join" in text and "ranks [0] joined but were not ready" in text, text
        assert "Traceback" not in text, text
        assert "left the torch.distributed rendezvous" in world.log("worker0"), world.log("worker0")
    finally:
        world.kill_all()
