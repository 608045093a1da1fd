"""`vllm-serve --launcher ray` on a local Ray instance (started here, on 127.0.0.2) with a TP 2 world: the same
greedy tokens as `vllm-serve` with local workers, each HF's argmax given the same prefix; the ranks run in Ray
actors, not as children of vllm-serve; `kill -9` of one actor's process is recovered by a replacement actor that
rejoins the rank, and so is a stopped (SIGSTOP) actor; SIGTERM drains and tears every actor down. The KV cache is
sized from free memory, as a user gets it: the replacement is told the world's size."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients.client import wait_ready
from minivllm.cluster import REPO, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.ops import Streams, alive, child_pids, greedy_ids, kill_with_children, prompt_ids, wait_for

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[dev]' brings it)")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# float32: compared with HF at 1e-3 (`auto` is bf16 on CPUs with AVX-512 BF16)
TP2 = ["--tensor-parallel-size", "2", "--swap-space", "0", "--threads", "1"]
TP2 += ["--dtype", "float32"]
PROMPTS = [prompt_ids(40 + i, n) for i, n in enumerate([1, 9, 17, 33])]
MAX_TOKENS = 10


class Serve:
    """vllm-serve as a user starts it, with its log in a file."""

    def __init__(self, model: Path, log: Path, extra: list[str]) -> None:
        self.port, self.log = free_port(), log
        argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(model), "--grpc-port", str(self.port),
                "--worker-port", str(free_port()), "--openai-port", "0", "--heartbeat-timeout", "3", *TP2,
                *extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        if not wait_ready(self.channel, 180):
            self.kill()
            raise TimeoutError(f"vllm-serve {' '.join(extra)} never became SERVING\n{log.read_text()[-6000:]}")

    def generate(self) -> list[list[int]]:
        stub = pb_grpc.GenerationStub(self.channel)
        return [[t for d in stub.Generate(greedy_ids(p, MAX_TOKENS), timeout=60) for t in d.token_ids] for p in PROMPTS]

    def workers(self) -> list[pb.WorkerStatus]:
        control = pb_grpc.ControlStub(self.channel)
        return list(control.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers)

    def stop(self) -> int:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def kill(self) -> None:
        self.channel.close()
        kill_with_children(self.proc)  # its scheduler too, which a failed test left running


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    context = ray.init(_node_ip_address="127.0.0.2", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield context.address_info["gcs_address"]
    ray.shutdown()


def test_ray_tp2_serves_the_tokens_of_vllm_serve_and_recovers_a_killed_actor(
    tiny_qwen2_dir: Path, ray_address: str, tmp_path: Path
) -> None:
    local = Serve(tiny_qwen2_dir, tmp_path / "local.log", [])
    try:
        expected = local.generate()
        assert local.stop() == 0
    finally:
        local.kill()
    served = Serve(tiny_qwen2_dir, tmp_path / "ray.log", ["--launcher", "ray", "--ray-address", ray_address])
    try:
        assert served.generate() == expected, served.log.read_text()[-4000:]
        workers = served.workers()
        pids = [w.pid for w in workers]
        assert sorted(w.rank for w in workers) == [0, 1] and all(w.state == "ready" for w in workers)
        assert child_pids(served.proc.pid) and not set(pids) & set(child_pids(served.proc.pid)), "not Ray actors"

        streams = Streams(pb_grpc.GenerationStub(served.channel), [greedy_ids(p, 120) for p in PROMPTS])
        streams.wait_all_started()
        victim = next(w for w in workers if w.rank == 0).pid
        os.kill(victim, signal.SIGKILL)
        assert min(len(r.tokens) for r in streams.results) < 120, "every stream ended before the kill"
        results = streams.join(120)
        for r in results:
            assert (r.code, r.finish_reason, len(r.tokens)) == (None, "length", 120), (r.details, served.log)

        def replaced() -> bool:
            return any(w.rank == 0 and w.state == "ready" and w.pid != victim for w in served.workers())

        wait_for(replaced, 30, "a new actor holds rank 0")
        log = served.log.read_text()
        assert "the worker actor of bundle 0 died" in log or "the worker actor of bundle 1 died" in log, log
        assert "'host': '127.0.0.2'" in log, "the topology names the node Ray placed the ranks on"

        def launcher_saw_every_actor_ready() -> bool:
            """Until the launcher knows it, an actor's unanswered ping is bounded by the join timeout, not the
            heartbeat's (a SIGSTOP a moment after the scheduler saw the rank ready once waited past 60 s): each
            bundle's last event in the log is its actor's worker seen ready (an actor killed before a ping
            reported it never logs it)."""
            last = dict(
                re.findall(r"the worker actor of bundle (\d) (is ready|died|exited|stalled)", served.log.read_text())
            )
            return last.get("0") == last.get("1") == "is ready"

        wait_for(launcher_saw_every_actor_ready, 30, "the launcher saw every actor's worker ready")
        stopped = next(w for w in served.workers() if w.rank == 1).pid
        os.kill(stopped, signal.SIGSTOP)  # alive to Ray, silent to everyone: its actor must be replaced
        wait_for(lambda: any(w.rank == 1 and w.state == "ready" and w.pid != stopped for w in served.workers()),
                 60, "a new actor holds the stopped rank")  # fmt: skip
        assert re.search(r"the worker actor of bundle \d stalled", served.log.read_text()), served.log.read_text()
        assert served.generate() == expected
        new_pids = [w.pid for w in served.workers()]
        assert served.stop() == 0, served.log.read_text()[-4000:]
        wait_for(lambda: not any(alive(p) for p in new_pids), 20, "every actor's process is gone")
    finally:
        served.kill()
        if "stopped" in locals() and alive(stopped):
            os.kill(stopped, signal.SIGKILL)
    hf = load_hf(tiny_qwen2_dir)
    for prompt, out in zip(PROMPTS, expected):
        assert len(out) == MAX_TOKENS
        assert_teacher_forced(hf, prompt, out)
    for prompt, r in zip(PROMPTS, results):
        assert_teacher_forced(hf, prompt, r.tokens)
