"""Real network faults: the scheduler, two TP workers and the client each on its own host (a network namespace
joined to one switch by a veth pair, tests/support/netns.py), and a host's cable pulled (its switch port down)
under several concurrent greedy streams:

(a) a worker's link down for 5 s, less than --heartbeat-timeout (10 s): no rank is lost; the streams pause (tensor
    parallelism needs both ranks at every layer) and resume, every token HF's greedy one;
(c) the scheduler's link down for 5 s (its clients and its workers are cut off): the same;
(b) a worker's link down for 20 s: rank 1 is declared lost after --heartbeat-timeout, rank 0 is told to leave, both
    rejoin once the cable is back, within --worker-rejoin-timeout (60 s): the streams resume by recompute and
    finish; and for 90 s: no world can form while the host is cut off, so at --heartbeat-timeout +
    --worker-rejoin-timeout (70 s) every stream ends UNAVAILABLE; once the cable is back the world serves again.

The scheduler runs with its default timeouts, as a user meets them. Nothing restarts a separately started
`vllm-worker` but its supervisor: on a real host systemd (deploy/systemd/minivllm-worker@.service, Restart=always,
RestartSec=2); here `Supervised` does the same. Every request ends within its fault's bound (the client's own
deadline shows a hang as DEADLINE_EXCEEDED), the world is rebuilt (health SERVING and a new request served), and
every process and namespace is removed, also when a check fails. Each case prints its figures (`pytest -s`):
docs/operations.md's failure table has them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from minivllm.cluster import REPO
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.netns import Network, Supervised
from tests.support.ops import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GRPC_PORT, WORKER_PORT, DISTRIBUTED_PORT = 50051, 50061, 29500  # every host is a fresh namespace: all free
HOSTS = {"sched": 1, "w0": 2, "w1": 3, "client": 4}  # 127.100.0.<n>
STREAMS = 4
START_BOUND = 180.0  # a fresh world: two workers load, meet at the rendezvous, size their caches


@dataclass
class Fault:
    host: str
    seconds: float
    max_tokens: int
    bound: float  # every stream ends within this many seconds of the cable's return


@dataclass
class Load:
    """The client's streams, run in the client's namespace; its events as they arrive."""

    proc: subprocess.Popen[str]
    events: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def tokens(self, i: int) -> int:
        return sum(e.get("n", 0) for e in list(self.events) if e["i"] == i)

    def ends(self) -> list[dict]:
        return sorted((e for e in self.events if "end" in e), key=lambda e: e["i"])

    def join(self, timeout: float) -> list[dict]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the client still ran {timeout:.0f} s after the fault: a stream hangs") from None
        self.reader.join(10)
        return self.ends()


class World:
    """vllm-scheduler on `sched`, a supervised vllm-worker on each of `w0` and `w1` (TP 2), clients on `client`."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.log_dir = log_dir
        Network.sweep("mvn")
        self.net = Network(f"mvn{os.getpid()}")
        self.env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, Supervised] = {}
        try:
            for name, octet in HOSTS.items():
                self.net.add_host(name, octet)
            self._start(model)
        except BaseException:
            self.close()
            raise

    def address(self, host: str) -> str:
        return self.net.hosts[host].address

    def _start(self, model: Path) -> None:
        topology = self.log_dir / "topology.yaml"
        groups = [f"  - {{host: {self.address(w)}, interconnect: loopback, device_ids: [0]}}\n" for w in ("w0", "w1")]
        topology.write_text("device: cpu\ngroups:\n" + "".join(groups))  # TP 2 across two hosts: cross-island
        sched = self.address("sched")
        argv = [sys.executable, "-m", "scheduler_node.cli.scheduler", "--model", str(model), "--dtype", "float32"]
        argv += ["--host", sched, "--port", str(GRPC_PORT), "--worker-host", sched, "--worker-port", str(WORKER_PORT)]
        argv += ["--tensor-parallel-size", "2", "--topology", str(topology), "--allow-cross-island"]
        argv += ["--distributed-port", str(DISTRIBUTED_PORT)]
        with open(self.log_dir / "scheduler.log", "wb") as log:
            self.scheduler = subprocess.Popen(
                self.net.argv("sched", argv), stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO
            )
        for name in ("w0", "w1"):
            argv = [sys.executable, "-m", "worker_node.worker", "--scheduler-address", f"{sched}:{WORKER_PORT}"]
            argv += ["--local-address", self.address(name), "--threads", "1", "--kv-cache-memory", "16MiB"]
            argv += ["--swap-space", "0"]
            self.workers[name] = Supervised(self.net.argv(name, argv), self.log_dir / f"{name}.log", self.env)
            self.workers[name].start()

    def client(self, *args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "tests.support.netns_client", args[0], f"{self.address('sched')}:{GRPC_PORT}"]
        return subprocess.Popen(
            self.net.argv("client", [*argv, *args[1:]]), stdout=subprocess.PIPE, text=True, env=self.env, cwd=REPO
        )

    def streams(self, count: int, max_tokens: int, bound: float) -> Load:
        return Load(self.client("streams", str(count), str(max_tokens), str(bound)))

    def probe(self, deadline: float) -> dict:
        """Health SERVING (within `deadline` s), the workers, and one new request served."""
        proc = self.client("probe", str(deadline))
        out, _ = proc.communicate(timeout=deadline + 90)
        assert self.scheduler is not None and self.scheduler.poll() is None, f"the scheduler exited\n{self.logs()}"
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert lines, f"the probe printed nothing\n{self.logs()}"
        return lines[-1]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def leftovers(self) -> list[str]:
        """Namespaces of this world, and its processes, still there."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        running = [f"worker {name}" for name, w in self.workers.items() if w.running]
        if self.scheduler is not None and self.scheduler.poll() is None:
            running.append("the scheduler")
        return [n for n in names if n.startswith(self.net.prefix)] + running

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        if self.scheduler is not None and self.scheduler.poll() is None:
            self.scheduler.terminate()
            try:
                self.scheduler.wait(40)
            except subprocess.TimeoutExpired:
                self.scheduler.kill()
                self.scheduler.wait()
        self.net.close()


@pytest.fixture(scope="module")
def world(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    reason = Network.unavailable()
    if reason:
        pytest.skip(reason)
    w = World(tiny_llama_dir, tmp_path_factory.mktemp("netns"))
    try:
        probe = w.probe(START_BOUND)
        assert probe["end"] == "", f"the world did not serve: {probe}\n{w.logs()}"
        yield w
    finally:
        w.close()
    assert not w.leftovers(), f"left behind: {w.leftovers()}"


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    return load_hf(tiny_llama_dir, torch.float32)


def resume_times(load: Load, down: float, up: float) -> list[float]:
    """Per stream: when its first event after the outage came (a token, or its end), in seconds after `down`."""
    out = []
    for i in range(STREAMS):
        times = sorted(e["t"] for e in load.events if e["i"] == i)
        # The longest gap that overlaps the outage: tokens already on their way may arrive just after `down`.
        gaps = [(b - a, b) for a, b in zip(times, times[1:]) if a < up and b > down]
        out.append(max(gaps)[1] - down if gaps else float("nan"))
    return out


@dataclass
class Outcome:
    ends: list[dict]  # each stream's end event, by stream
    probe: dict  # after the streams ended: health SERVING, the workers, one new request
    figures: dict


def run_fault(world: World, fault: Fault) -> Outcome:
    """Streams running, the cable of `fault.host` out for `fault.seconds`, then every stream's end and a probe."""
    before = {name: w.pid for name, w in world.workers.items()}
    load = world.streams(STREAMS, fault.max_tokens, fault.seconds + fault.bound)
    wait_for(lambda: all(load.tokens(i) >= 8 for i in range(STREAMS)), 120, "every stream is under way")
    down = time.monotonic()
    world.net.set_link(fault.host, up=False)
    try:
        time.sleep(fault.seconds)  # the outage itself: what the test is about, not a wait for a condition
    finally:
        world.net.set_link(fault.host, up=True)
    up = time.monotonic()
    ends = load.join(fault.bound + 30)
    asked = time.monotonic()
    probe = world.probe(START_BOUND)
    figures = {
        "fault": f"{fault.host} link down {fault.seconds:g} s",
        "resumed_or_ended_after_down_s": [round(t, 1) for t in resume_times(load, down, up)],
        "ended_after_up_s": [round(e["t"] - up, 1) for e in ends],
        "statuses": [e["end"] or "OK" for e in ends],
        "details": sorted({e["details"] for e in ends if e["details"]}),
        "workers_replaced": [name for name, w in world.workers.items() if w.pid != before[name]],
    }
    if figures["workers_replaced"]:  # the world was lost: when it served again (streams resumed, or the probe's)
        resumed = [e["t"] for e in load.events if "n" in e and e["t"] > up]
        serving = asked + (probe["serving_after"] or float("nan"))
        figures["serving_again_after_up_s"] = round(min(resumed + [serving]) - up, 1)
    print(json.dumps(figures))  # the figures of docs/operations.md's failure table (pytest -s shows them)
    assert len(ends) == STREAMS, f"{len(ends)} of {STREAMS} streams ended: {figures}\n{world.logs()}"
    assert all(e["t"] - up < fault.bound for e in ends), f"a stream ended late: {figures}\n{world.logs()}"
    assert probe["end"] == "" and len(probe["tokens"]) == 8, f"no new request served: {probe}\n{world.logs()}"
    assert [w["state"] for w in probe["workers"]] == ["ready", "ready"], probe
    return Outcome(ends, probe, figures)


def check_completed(world: World, outcome: Outcome, fault: Fault, hf) -> None:  # type: ignore[no-untyped-def]
    """Every stream paused for the outage (it did cut them), then finished with every token, each HF's greedy one
    given the same prefix (a recompute after a lost world must continue where the stream was)."""
    for e, resumed in zip(outcome.ends, outcome.figures["resumed_or_ended_after_down_s"]):
        assert e["end"] == "", f"stream {e['i']} ended {e['end']}: {e['details']}\n{world.logs()}"
        assert len(e["tokens"]) == fault.max_tokens
        assert_teacher_forced(hf, e["prompt"], e["tokens"])
        assert resumed >= fault.seconds - 0.5, f"stream {e['i']} did not pause: {outcome.figures}"


@pytest.mark.parametrize("host", ["w1", "sched"], ids=["worker", "scheduler"])
def test_link_down_5s_streams_pause_and_resume(world: World, hf, host: str) -> None:  # type: ignore[no-untyped-def]
    """Within --heartbeat-timeout: no rank is lost, no worker restarts; TCP carries the streams over the outage
    (its retransmission backoff adds a second or two after the cable is back)."""
    fault = Fault(host, 5.0, 300, bound=60.0)
    outcome = run_fault(world, fault)
    check_completed(world, outcome, fault, hf)
    assert max(outcome.figures["resumed_or_ended_after_down_s"]) < fault.seconds + 15, outcome.figures
    assert not outcome.figures["workers_replaced"], "a 5 s outage is within the heartbeat timeout"


def test_worker_link_down_20s_world_rebuilt_streams_complete(world: World, hf) -> None:  # type: ignore[no-untyped-def]
    """Past --heartbeat-timeout (10 s), within --worker-rejoin-timeout (60 s): rank 1 is lost, rank 0 is told to
    leave, and once the cable is back both rejoin (restarted by their supervisor); the requests, back to waiting
    meanwhile, resume by recompute and finish."""
    fault = Fault("w1", 20.0, 400, bound=120.0)
    outcome = run_fault(world, fault)
    check_completed(world, outcome, fault, hf)
    assert sorted(outcome.figures["workers_replaced"]) == ["w0", "w1"], "a TP world restarts every rank"


def test_worker_link_down_90s_streams_end_unavailable_then_world_rebuilt(world: World) -> None:
    """Past --heartbeat-timeout + --worker-rejoin-timeout (70 s): every stream ends UNAVAILABLE, saying why, at
    70 s; once the cable is back the world is rebuilt and serves new requests."""
    fault = Fault("w1", 90.0, 900, bound=60.0)
    outcome = run_fault(world, fault)
    for e, ended in zip(outcome.ends, outcome.figures["resumed_or_ended_after_down_s"]):
        assert e["end"] == "UNAVAILABLE" and "no worker rejoined within 60 s" in e["details"], e
        assert 70 - 5 < ended < 70 + 15, outcome.figures
    assert sorted(outcome.figures["workers_replaced"]) == ["w0", "w1"], "a TP world restarts every rank"
