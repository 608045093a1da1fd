"""vllm-serve starts a scheduler and its workers, serves gRPC and the OpenAI API, drains on SIGTERM (HTTP answers
503 meanwhile while the live stream finishes) and stops them all cleanly; with --data-parallel-size, SIGHUP
restarts the replicas one at a time, their streams migrated."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from clients.client import wait_ready
from minivllm.cluster import REPO, free_port
from minivllm.tiny_models import build_tiny_model
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.cli.serve import build_parser, replica_argv, replica_plans
from tests.support.ops import (
    SERVING,
    Streams,
    alive,
    child_pids,
    greedy_ids,
    health_status,
    kill_with_children,
    prompt_ids,
    wait_for,
)

pytestmark = pytest.mark.e2e


def assert_stops_with_its_children(serve: subprocess.Popen, sig: int, expected_children: int) -> None:
    children = child_pids(serve.pid)
    assert len(children) == expected_children, children
    serve.send_signal(sig)
    assert serve.wait(60) == 0
    wait_for(lambda: not any(alive(pid) for pid in children), 10, "no child outlives vllm-serve")


KEY = "sk-serve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_serve_turns_the_openai_api_on_at_8000() -> None:
    assert build_parser().parse_args([]).openai_port == 8000


def test_serve_picks_a_free_worker_port_unless_one_is_given() -> None:
    for flags, expected in (([], None), (["--worker-port", "6000"], 6000)):
        args = build_parser().parse_args(flags)
        (plan,) = replica_plans(args)
        assert plan.worker_port == expected or (expected is None and plan.worker_port not in (0, 50061)), flags
        argv = replica_argv(args, plan, 1)
        assert argv[argv.index("--worker-port") + 1] == str(plan.worker_port)  # the scheduler binds where they join


def serve_with_default_worker_port(model: Path, port: int, http_port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(model), "--kv-cache-memory", "16MiB",
            "--threads", "1", "--log-level", "WARNING", "--grpc-port", str(port),
            "--openai-port", str(http_port)]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO)


def test_two_serves_on_one_host_with_default_worker_ports_each_serve(tiny_llama_dir: Path) -> None:
    """A fixed worker port made the second fail to bind it ("Address already in use") while its worker joined the
    first one's scheduler ("every rank is taken")."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    serves = [serve_with_default_worker_port(tiny_llama_dir, port, http_port) for port, http_port in ports]
    try:
        for (port, http_port), serve in zip(ports, serves):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert wait_ready(channel, 120), f"vllm-serve at {port} never became SERVING"
            body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
            answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
            assert len(child_pids(serve.pid)) == 2  # its own scheduler and worker, none restarted
        for serve in serves:
            serve.send_signal(signal.SIGTERM)
        assert [serve.wait(30) for serve in serves] == [0, 0]
    finally:
        for serve in serves:
            kill_with_children(serve)


def test_serve_runs_and_stops_all_children_on_sigterm(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port, worker_port, http_port = free_port(), free_port(), free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {tiny_llama_dir}\nkv-cache-memory: 16MiB\nthreads: 1\nlog-level: WARNING\napi-key: {KEY}\n"
    )
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--config", str(config),
            "--grpc-port", str(port), "--worker-port", str(worker_port), "--port", str(http_port)]  # fmt: skip
    serve = subprocess.Popen(argv, cwd=REPO)
    url = f"http://127.0.0.1:{http_port}"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert wait_ready(channel, 120), "vllm-serve never became SERVING"
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=5, temperature=0))
            deltas = list(stub.Generate(request, timeout=60))
            assert deltas[-1].usage.completion_tokens == 5
        assert httpx.get(url + "/health").status_code == 200
        children = child_pids(serve.pid)
        assert len(children) == 2, children  # the scheduler and one worker
        assert not [pid for pid in children if KEY in command_line(pid)], "the API key is on a command line"
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
        body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}  # outlasts the checks
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as live:
            chunks = live.iter_lines()
            assert next(chunks).startswith("data: ")
            serve.send_signal(signal.SIGTERM)  # the scheduler drains: the live stream goes on, new work is refused
            wait_for(lambda: httpx.get(url + "/health").status_code != 200, 10, "/health leaves 200 while draining")
            refused = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=AUTH)
            assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
            assert [line for line in chunks if line][-1] == "data: [DONE]"
        assert serve.wait(30) == 0
        wait_for(lambda: not any(alive(pid) for pid in children), 10, "no child outlives vllm-serve")
    finally:
        if serve.poll() is None:
            serve.kill()


SHUTDOWN_TIMEOUT = 3.0
ENDLESS = 6000  # tokens of the streams that must outlast the shutdown timeout
ROLLING_TOKENS = 2000  # tokens of the streams that must outlast the SIGHUP's first drain (about 0.8 s at 0.4 ms a step)


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny llama with room for ENDLESS tokens: 1,000 could finish within the shutdown timeout on a fast idle
    CPU (seven streams at ~3 ms a step), so the streams that must outlast it are longer than that can hold."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("long-llama"), smollm2_dir, max_position_embeddings=8192)


def test_sigterm_refuses_new_work_with_retry_after_then_ends_what_outlasts_shutdown_timeout(
    long_llama_dir: Path,
) -> None:
    """Graceful shutdown as an orchestrator does it: SIGTERM to vllm-serve. New requests are refused at once (gRPC
    UNAVAILABLE with a retry-after trailer, HTTP 503 with Retry-After); running streams that can finish within
    --shutdown-timeout do; the rest end with UNAVAILABLE saying why (gRPC status, an error event in the SSE
    stream); vllm-serve exits 0 with its children."""
    port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(long_llama_dir), "--kv-cache-memory",
            "64MiB", "--threads", "1", "--log-level", "WARNING", "--grpc-port", str(port), "--worker-port",
            str(free_port()), "--openai-port", str(http_port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]  # fmt: skip
    serve = subprocess.Popen(argv, cwd=REPO)
    url = f"http://127.0.0.1:{http_port}"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert wait_ready(channel, 120), "vllm-serve never became SERVING"
            stub = pb_grpc.GenerationStub(channel)
            short = [greedy_ids(prompt_ids(70 + i), 8) for i in range(2)]
            endless = [greedy_ids(prompt_ids(80 + i), ENDLESS) for i in range(6)]  # cannot finish in 3 s on a CPU
            streams = Streams(stub, short + endless)
            body = {"prompt": "hi", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as live:
                lines = live.iter_lines()
                assert next(lines).startswith("data: ")
                streams.wait_all_started()
                children = child_pids(serve.pid)
                serve.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                wait_for(lambda: health_status(channel) != SERVING, 10, "NOT_SERVING once SIGTERM is in")
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Generate(greedy_ids(prompt_ids(90), 2), timeout=10))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert ("retry-after", "5") in (refused.value.trailing_metadata() or ()), "gRPC retry-after trailer"
                late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
                assert (late.status_code, late.headers.get("retry-after")) == (503, "5")
                assert "draining" in late.json()["error"]["message"]
                tail = [line for line in lines if line]
            results = streams.join(SHUTDOWN_TIMEOUT + 30)
        for r in results[:2]:
            assert (r.code, r.finish_reason, len(r.tokens)) == (None, "length", 8), r.details
        for r in results[2:]:
            assert r.code == grpc.StatusCode.UNAVAILABLE and len(r.tokens) < ENDLESS, (r.code, len(r.tokens))
            assert "shutting down: --shutdown-timeout (3 s) passed" in r.details, r.details
            assert r.ended_at - signalled < SHUTDOWN_TIMEOUT + 10
        assert tail[-1] == "data: [DONE]"
        error = json.loads(tail[-2].removeprefix("data: "))["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"], error
        assert serve.wait(30) == 0
        wait_for(lambda: not [pid for pid in children if alive(pid)], 10, "children end with vllm-serve")
    finally:
        if serve.poll() is None:
            serve.kill()


def scheduler_pids(serve: subprocess.Popen) -> list[int]:
    return sorted(pid for pid in child_pids(serve.pid) if "scheduler_node.cli.scheduler" in command_line(pid))


def test_serve_data_parallel_replicas_behind_a_router_balance_restart_on_sighup_and_stop(
    long_llama_dir: Path, tmp_path: Path
) -> None:
    port, worker_port, http_port = free_port(), free_port(), free_port()
    # --batch-invariant: the seeded streams a restart migrates keep the bits of an undisturbed run, whatever shares
    # their batch before and after.
    argv = [sys.executable, "-m", "scheduler_node.cli.serve", "--model", str(long_llama_dir), "--data-parallel-size",
            "2", "--routing-strategy", "least_loaded", "--kv-cache-memory", "32MiB", "--threads", "1", "--log-level",
            "INFO", "--grpc-port", str(port), "--worker-port", str(worker_port),
            "--openai-port", str(http_port),
            "--batch-invariant"]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("wb") as out:  # the children write here too
        serve = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "MINIVLLM_API_KEY": KEY}, stderr=out)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert wait_ready(channel, 120), "the router never became SERVING"
            control = pb_grpc.ControlStub(channel)

            def replicas() -> list[pb.ReplicaStatus]:
                return list(control.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas)

            wait_for(lambda: [r.state for r in replicas()] == ["serving", "serving"], 120, "both replicas serving")
            assert {r.model for r in replicas()} == {long_llama_dir.name}
            # Long enough that the burst is in flight at once: least_loaded then splits it by the router's own open
            # streams. With 16 tokens the first streams ended before the last began on a loaded machine, and the
            # faster replica rightly took more (15/25 in CI): a split by speed, not what this checks.
            requests = [greedy_ids(prompt_ids(i), 64) for i in range(40)]
            results = Streams(pb_grpc.GenerationStub(channel), requests).join(120)
            assert all(r.finish_reason == "length" and len(r.tokens) == 64 for r in results)
            counts = [r.requests for r in replicas()]
            assert sum(counts) == 40 and all(abs(c - 20) <= 0.2 * 20 for c in counts), counts  # within 20 %
        # The OpenAI API is the router's too: it lists the model and forwards to a replica with the replicas' key.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [long_llama_dir.name]
        answer = client.completions.create(model=long_llama_dir.name, prompt="hi", max_tokens=5, temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        assert httpx.get(f"http://127.0.0.1:{http_port}/v1/models").status_code == 401  # the router checks the key
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            rolling_restart_loses_no_stream(serve, channel, log)
        assert_stops_with_its_children(serve, signal.SIGTERM, 5)  # the router, two schedulers, a worker each
    finally:
        kill_with_children(serve)


def rolling_restart_loses_no_stream(serve: subprocess.Popen, channel: grpc.Channel, log: Path) -> None:
    """SIGHUP mid-stream (issue 31): each replica in turn drained with migrate, restarted (a new scheduler) and
    routed again; every greedy and seeded stream ends with the tokens of an undisturbed run, vllm-serve runs on."""
    stub, control = pb_grpc.GenerationStub(channel), pb_grpc.ControlStub(channel)
    # The streams must still run when the rolling thread drains replica 0, ~60 ms after the signal on an idle
    # machine. At 128 tokens one loaded run in four saw replica 0's streams end first; at 256 an idle Sapphire
    # Rapids (about 0.4 ms a step for this model) ran them out between two polls; at 960 a CI run under load
    # drained replica 0 after its streams had ended.
    requests = [greedy_ids(prompt_ids(500 + i), ROLLING_TOKENS) for i in range(4)]
    for i in range(4):
        sampling = pb.SamplingParams(max_tokens=ROLLING_TOKENS, temperature=0.8, seed=7 + i, ignore_eos=True)
        requests.append(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids(600 + i)), sampling=sampling))
    expected = Streams(stub, requests).join(120)
    # least_loaded reads each replica's polled queue until its next poll: a poll taken while `expected` ran would
    # send every stream below to the other replica (CI once saw all eight on replica 1, none to migrate off 0).
    wait_for(
        lambda: all(
            r.num_running + r.num_waiting + r.in_flight == 0
            for r in control.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas
        ),
        30,
        "replicas idle",
    )
    before = scheduler_pids(serve)
    streams = Streams(stub, requests, timeout=300)
    wait_for(lambda: all(len(r.tokens) >= 2 for r in streams.results), 60, "every stream runs")
    serve.send_signal(signal.SIGHUP)
    for i, (got, want) in enumerate(zip(streams.join(300), expected)):
        assert got.code is None, (i, got.code, got.details)
        assert got.tokens == want.tokens and got.finish_reason == "length", i
    wait_for(lambda: "rolling restart done: 2 replicas restarted" in log.read_text(), 120, "the restart ends")
    assert serve.poll() is None
    after = scheduler_pids(serve)
    assert len(after) == 2 and not set(after) & set(before), (before, after)
    text = log.read_text()
    migrated = re.search(r"replica 0 \(.*\): (\d+) request\(s\) migrated", text)
    rolling = "\n".join(line for line in text.splitlines() if "rolling" in line or "route" in line)
    assert migrated and int(migrated.group(1)) >= 1, f"replica 0 ran streams when the SIGHUP came:\n{rolling}"
    # each exited by itself once drained (--exit-after-drain), not at a SIGTERM
    assert text.count("exiting (--exit-after-drain)") == 2 and "stopping it with SIGTERM" not in text
    (again,) = Streams(stub, [greedy_ids(prompt_ids(500), 16)]).join(60)
    assert again.tokens == expected[0].tokens[:16]
