"""The disk KV tier through real processes: a worker process offloads over ZeroMQ plans, and a new scheduler and
worker over the same folder (a restart), or a replacement worker after the first was killed (a world restart),
answer the first request's prefix from the disk tier. A disk that fills up costs the tier, never a request; a
folder the tier cannot use is refused at start in one line."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from minivllm.cluster import REPO, Cluster, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from tests.support.ops import add_worker, child_pids, rank0, wait_for

pytestmark = pytest.mark.e2e

PREFIX = 48  # three full blocks of 16


def ask(cluster: Cluster, ids: list[int]) -> list[int]:
    stub = pb_grpc.GenerationStub(cluster.channel)
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling)
    return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]


def start(model: Path, disk: Path) -> Cluster:
    cluster = Cluster(
        model,
        ["--block-size", "16", "--num-kv-blocks", "12"],
        ["--swap-space", "0.01", "--kv-offload-disk", str(disk), "--kv-offload-disk-size", "0.02"],
    )
    cluster.wait_serving()
    return cluster


def test_a_restarted_server_hits_the_disk_tier_from_its_first_request(tiny_llama_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(3, 49152) for _ in range(PREFIX)]
    question = [rng.randrange(3, 49152) for _ in range(5)]
    cluster = start(tiny_llama_dir, tmp_path)
    try:
        before = ask(cluster, prefix + question)
        for _ in range(3):  # unrelated prompts that take the whole device pool: the prefix goes to disk
            ask(cluster, [rng.randrange(3, 49152) for _ in range(64)])
    finally:
        cluster.stop()
    cluster = start(tiny_llama_dir, tmp_path)
    try:
        after = ask(cluster, prefix + question)
        stats = pb_grpc.ControlStub(cluster.channel).GetStats(pb.GetStatsRequest(), timeout=5)
    finally:
        cluster.stop()
    assert stats.prefix_cache_hits == PREFIX, "a fresh server's first request found its prefix on disk"
    assert after == before


def test_a_replacement_worker_brings_the_disk_tier_back(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A world restart (the worker killed, a replacement joins): the replacement re-opens the disk file and the
    scheduler offers its intact blocks again (a RAM tier's blocks die with the worker)."""
    rng = random.Random(6)
    prefix = [rng.randrange(3, 49152) for _ in range(PREFIX)]
    question = [rng.randrange(3, 49152) for _ in range(5)]
    worker = ["--swap-space", "0.01", "--kv-offload-disk", str(tmp_path), "--kv-offload-disk-size", "0.02"]
    cluster = Cluster(tiny_llama_dir, ["--block-size", "16", "--num-kv-blocks", "12"], worker)
    control = pb_grpc.ControlStub(cluster.channel)
    try:
        cluster.wait_serving()
        before = ask(cluster, prefix + question)
        for _ in range(3):  # unrelated prompts that take the whole device pool: the prefix goes to disk
            ask(cluster, [rng.randrange(3, 49152) for _ in range(64)])
        victim = cluster.workers[0]
        victim.kill()
        victim.wait(10)
        wait_for(lambda: rank0(cluster).state == "lost", 10, "rank 0 reported lost")
        hits = control.GetStats(pb.GetStatsRequest(), timeout=5).prefix_cache_hits
        add_worker(cluster, "replacement", worker)
        replacement = cluster.workers[-1].pid
        wait_for(lambda: (rank0(cluster).state, rank0(cluster).pid) == ("ready", replacement), 120, "replaced")
        after = ask(cluster, prefix + question)
        stats = control.GetStats(pb.GetStatsRequest(), timeout=5)
    finally:
        cluster.kill()
    assert stats.prefix_cache_hits - hits == PREFIX, "the replacement's first request found its prefix on disk"
    assert after == before


@contextlib.contextmanager
def tmpfs(where: Path, *options: str) -> Iterator[Path]:
    """A tiny tmpfs mounted at `where` for the test (skipped where this process may not mount)."""
    where.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_tier_drops_blocks_not_requests(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The issue's scenario: the disk tier on a filesystem far smaller than --kv-offload-disk-size. The worker
    warns at start; the writes the full disk refuses drop their blocks and turn the tier off (logged once); every
    request completes, the prefix asked again is served (from the device cache or recomputed)."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 49152) for _ in range(PREFIX)]
    with tmpfs(tmp_path / "disk", "size=8k") as disk:  # the file's header page, and one page of blocks
        cluster = Cluster(
            tiny_llama_dir,
            ["--block-size", "16", "--num-kv-blocks", "12"],
            ["--swap-space", "0.01", "--kv-offload-disk", str(disk), "--kv-offload-disk-size", "1"],
        )
        try:
            cluster.wait_serving()
            answers = [ask(cluster, prefix + [5, 6])]
            for _ in range(4):  # unrelated prompts that take the whole device pool: blocks go to the disk tier
                answers.append(ask(cluster, [rng.randrange(3, 49152) for _ in range(64)]))
            answers.append(ask(cluster, prefix + [5, 6]))
        finally:
            cluster.stop()
        logs = cluster.logs()
    assert [len(a) for a in answers] == [4] * 6, "every request completed"
    assert answers[-1] == answers[0]
    assert "--kv-offload-disk-size asks 1.00 GiB but its filesystem has 0.00 GiB free" in logs
    assert "not written ([Errno 28] No space left on device); dropped" in logs
    assert logs.count("the disk KV tier could not store") == 1, "turned off once"
    assert "could not run step" not in logs


def _refusal(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a command that should refuse to start; one that starts anyway is stopped with its children (each in
    its own session) after `timeout` seconds, and the test fails."""
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in child_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{argv[0]} did not refuse to start within {timeout} s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_a_disk_tier_folder_it_cannot_use_is_refused_at_start(tiny_llama_dir: Path, tmp_path: Path, kind: str) -> None:
    """A read-only or non-folder --kv-offload-disk: vllm-serve and vllm-worker exit 2 at once with one line naming
    the flag (the worker exited 1 and vllm-serve restarted it forever, health 503)."""
    with contextlib.ExitStack() as stack:
        if kind == "file":
            bad = tmp_path / "a-file"
            bad.write_text("not a folder")
            reason = "not a folder"
        else:
            bad = stack.enter_context(tmpfs(tmp_path / "ro", "ro", "size=8k"))
            reason = "cannot write in it (Read-only file system)"
        line = f"--kv-offload-disk {bad}: {reason}"
        ports = ["--grpc-port", str(free_port()), "--worker-port", str(free_port()), "--port", "0"]
        serve = _refusal(
            ["scheduler_node.cli.serve", "--model", str(tiny_llama_dir), *ports, "--kv-offload-disk", str(bad)]
        )
        worker = _refusal(
            ["worker_node.worker", "--scheduler-address", f"127.0.0.1:{free_port()}", "--kv-offload-disk", str(bad)]
        )
    for run in (serve, worker):
        assert run.returncode == 2, run.stderr[-2000:]
        errors = [x for x in run.stderr.splitlines() if " ERROR " in x]
        assert len(errors) == 1 and errors[0].endswith(line), run.stderr[-2000:]
