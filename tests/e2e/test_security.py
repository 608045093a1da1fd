"""TLS, the Control token, ZMQ CURVE, and fuzzing: malformed GenerateRequests get INVALID_ARGUMENT, random
bytes on the ZMQ sockets crash neither the scheduler nor a worker. Real processes, tiny model."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.cluster import REPO, Cluster, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.curve import AUTHORIZED, CLIENT, SERVER, configure_client, ensure_keys
from proto.wire import (
    WIRE_VERSION,
    Assignment,
    CachedRequest,
    Heartbeat,
    Kind,
    Message,
    NewRequest,
    SamplingOptions,
    Shutdown,
    StepError,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerReady,
    decode,
    encode,
)
from tests.support.clusters import serving
from tests.support.ops import TINY_WORKER, VOCAB, greedy_ids, list_workers, prompt_ids, wait_idle

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-token"
INT64 = st.integers(-(2**63), 2**63 - 1)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- TLS and the Control token


@pytest.fixture(scope="module")
def tls_cluster(tiny_llama_dir: Path, tls_files: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    cert, key = tls_files
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--control-token", TOKEN]
    c = Cluster(tiny_llama_dir, args, TINY_WORKER)
    c.channel.close()
    c.channel = grpc.secure_channel(c.address, grpc.ssl_channel_credentials(cert.read_bytes()))
    with serving(c):
        yield c


def test_tls_serves_and_plaintext_is_refused(tls_cluster: Cluster, tls_files: tuple[Path, Path]) -> None:
    stub = pb_grpc.GenerationStub(tls_cluster.channel)
    assert list(stub.Generate(greedy_ids(prompt_ids(1), 3), timeout=30))[-1].finish_reason == "length"
    with grpc.insecure_channel(tls_cluster.address) as plain:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerationStub(plain).Generate(greedy_ids(prompt_ids(1), 3), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    client = [sys.executable, "-m", "clients.client", "--port", str(tls_cluster.port), "--tls-ca",
              str(tls_files[0]), "--max-tokens", "3", "--temperature", "0", "hello"]  # fmt: skip
    out = subprocess.run(client, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "[length: " in out.stderr, out.stderr


def test_control_needs_the_token(tls_cluster: Cluster, tls_files: tuple[Path, Path]) -> None:
    control = pb_grpc.ControlStub(tls_cluster.channel)
    calls = [
        lambda md: control.GetStats(pb.GetStatsRequest(), timeout=5, metadata=md),
        lambda md: control.ListWorkers(pb.ListWorkersRequest(), timeout=5, metadata=md),
        lambda md: control.Drain(pb.DrainRequest(timeout_s=0.1), timeout=5, metadata=md),
        lambda md: control.ResizeCache(pb.ResizeCacheRequest(num_blocks=1), timeout=5, metadata=md),
    ]
    for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call(metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
    good = (("authorization", f"Bearer {TOKEN}"),)
    assert calls[0](good).total_blocks > 0
    assert [w.state for w in list_workers(tls_cluster, good)] == ["ready"]
    stub = pb_grpc.GenerationStub(tls_cluster.channel)  # Generation stays open
    assert list(stub.Generate(greedy_ids(prompt_ids(2), 2), timeout=30))[-1].finish_reason == "length"
    stats = [sys.executable, "-m", "clients.client", "stats", "--port", str(tls_cluster.port),
             "--tls-ca", str(tls_files[0])]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_CONTROL_TOKEN"}
    with_token = subprocess.run([*stats, "--control-token", TOKEN], cwd=REPO, capture_output=True, text=True, env=env)
    assert with_token.returncode == 0 and "total_blocks" in with_token.stdout, with_token.stderr
    without = subprocess.run(stats, cwd=REPO, capture_output=True, text=True, env=env)
    assert without.returncode != 0 and "UNAUTHENTICATED" in without.stderr, without.stderr


# ---- random bytes at the scheduler's worker socket


def _junk(kinds: tuple[Kind, ...] = tuple(Kind)) -> st.SearchStrategy[list[bytes]]:
    """Frames of random bytes, or msgpack that looks like a wire message of one of `kinds` with random fields."""
    wire = st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda k, f: msgpack.packb([WIRE_VERSION, [k, *f]]),
            st.sampled_from(kinds),
            st.lists(st.one_of(INT64, st.text(max_size=8), st.none(), st.lists(INT64)), max_size=12),
        ),  # fmt: skip
        st.builds(lambda f: msgpack.packb(f), st.lists(st.integers(-1, 10), max_size=4)),
    )
    return st.lists(wire, min_size=1, max_size=3)


def test_random_bytes_on_the_worker_socket_never_hurt_the_scheduler(tls_cluster: Cluster) -> None:
    good = (("authorization", f"Bearer {TOKEN}"),)
    pid = list_workers(tls_cluster, good)[0].pid
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{tls_cluster.worker_port}")

    @FUZZ
    @given(frames=_junk())
    def fuzz(frames: list[bytes]) -> None:
        sock.send_multipart(frames)

    try:
        fuzz()
        # valid messages from a stranger: a Hello is turned away, results and heartbeats are ignored
        stranger: list[Message] = [
            StepResult(1, {9: [1]}),
            StepError(1, 0, "no"),
            Heartbeat(0, 1, 5.0),
            WorkerReady(0, 9, 9),
        ]
        for message in stranger:
            sock.send(encode(message))
        sock.send(encode(WorkerHello("intruder", 1, "cpu")))
        assert sock.poll(5000), "no answer to an extra worker's Hello"
        assert isinstance(decode(sock.recv()), Shutdown)
        _raw_tcp_garbage(tls_cluster.worker_port)
    finally:
        sock.close()
        ctx.term()
    stub = pb_grpc.GenerationStub(tls_cluster.channel)
    assert list(stub.Generate(greedy_ids(prompt_ids(3), 3), timeout=30))[-1].finish_reason == "length"
    (w,) = list_workers(tls_cluster, good)
    assert (w.state, w.pid) == ("ready", pid)
    assert tls_cluster.scheduler.poll() is None


def _raw_tcp_garbage(port: int) -> None:
    """A peer that speaks no ZMTP at all."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(bytes(range(256)) * 8)
        time.sleep(0.2)  # the scenario: the peer stays connected a moment, as a real one would, then hangs up


# ---- CURVE, and fuzzed GenerateRequests


@pytest.fixture(scope="module")
def curve_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_keys(tmp_path_factory.mktemp("curve") / "keys")


@pytest.fixture(scope="module")
def curve_cluster(tiny_llama_dir: Path, curve_dir: Path):  # type: ignore[no-untyped-def]
    flag = ["--zmq-curve-dir", str(curve_dir)]
    with serving(Cluster(tiny_llama_dir, flag, [*TINY_WORKER, *flag])) as c:
        yield c


def test_curve_admits_only_authorized_workers(curve_cluster: Cluster, curve_dir: Path, tmp_path: Path) -> None:
    assert (curve_dir / f"{SERVER}.key_secret").stat().st_mode & 0o077 == 0
    assert (curve_dir / AUTHORIZED / f"{CLIENT}.key").is_file()
    stranger_keys = ensure_keys(tmp_path / "stranger")  # a valid CURVE client, but not an authorized key
    (stranger_keys / f"{SERVER}.key").write_bytes((curve_dir / f"{SERVER}.key").read_bytes())
    ctx = zmq.Context()
    try:
        for curve in (None, stranger_keys):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                configure_client(sock, curve)
            sock.connect(f"tcp://127.0.0.1:{curve_cluster.worker_port}")
            sock.send(encode(WorkerHello("intruder", 1, "cpu")))
            assert not sock.poll(1500), f"the scheduler answered an unauthorized peer ({curve})"
            sock.close()
    finally:
        ctx.term()
    stub = pb_grpc.GenerationStub(curve_cluster.channel)
    assert list(stub.Generate(greedy_ids(prompt_ids(4), 3), timeout=30))[-1].finish_reason == "length"
    assert [w.state for w in list_workers(curve_cluster)] == ["ready"]


def _invalid_request() -> st.SearchStrategy[tuple[str, pb.GenerateRequest]]:
    """A request with exactly one invalid field (named), everything else random but valid."""
    neg = st.floats(max_value=-1e-3, allow_nan=False)

    def sampling(field: str, value: object) -> tuple[str, dict]:
        return f"sampling.{field}", {field: value}

    bad = st.one_of(
        st.integers(-(2**31), 0).map(lambda v: sampling("max_tokens", v)),
        st.one_of(neg, st.just(math.nan), st.just(math.inf)).map(lambda v: sampling("temperature", v)),
        st.one_of(st.floats(max_value=0.0, allow_nan=False), st.floats(min_value=1.01), st.just(math.nan)).map(
            lambda v: sampling("top_p", v)
        ),
        st.integers(-(2**31), -2).map(lambda v: sampling("top_k", v)),
        st.one_of(st.integers(-(2**31), 0), st.integers(65, 2**31 - 1)).map(lambda v: sampling("n", v)),
        st.one_of(st.integers(-(2**31), -1), st.integers(21, 2**31 - 1)).map(lambda v: sampling("logprobs", v)),
        st.lists(st.text(max_size=3), min_size=17, max_size=30).map(lambda v: sampling("stop", v)),
        st.text(min_size=257, max_size=300).map(lambda v: ("request_id", {"request_id": v})),
        st.one_of(neg, st.just(math.nan), st.just(-math.inf)).map(lambda v: ("deadline_s", {"deadline_s": v})),
        st.one_of(st.integers(VOCAB, 2**31 - 1), st.integers(-(2**31), -1)).map(
            lambda v: ("prompt_token_ids", {"prompt_token_ids": pb.TokenIds(ids=[5, v])})
        ),
        st.just(("prompt", {"prompt": ""})),
        st.just(("messages", {"messages": pb.ChatMessages()})),
    )

    def build(choice: tuple[str, dict], prompt: str, seed: int, priority: int) -> tuple[str, pb.GenerateRequest]:
        field, change = choice
        fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
        sampling = pb.SamplingParams(
            **{"max_tokens": 2, "seed": seed, **{k: v for k, v in change.items() if k in fields}}
        )
        request_kw = {k: v for k, v in change.items() if k not in fields}
        if not {"prompt", "prompt_token_ids", "messages"} & set(request_kw):
            request_kw["prompt"] = prompt
        return field, pb.GenerateRequest(priority=priority, sampling=sampling, **request_kw)

    return st.builds(build, bad, st.text(min_size=1, max_size=20), st.integers(0, 2**31), st.integers(-5, 5))


def test_fuzzed_generate_requests_get_invalid_argument(curve_cluster: Cluster) -> None:
    stub = pb_grpc.GenerationStub(curve_cluster.channel)

    @FUZZ
    @given(case=_invalid_request())
    def fuzz(case: tuple[str, pb.GenerateRequest]) -> None:
        field, request = case
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert err.value.details().startswith(field), (field, err.value.details())

    fuzz()
    assert list(stub.Generate(greedy_ids(prompt_ids(5), 3), timeout=30))[-1].finish_reason == "length"
    stats = wait_idle(pb_grpc.ControlStub(curve_cluster.channel))
    assert stats.free_blocks == stats.total_blocks


# ---- random bytes at a worker (the test plays the scheduler)


def test_random_bytes_never_crash_a_worker(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker_node.worker", "--scheduler-address", f"127.0.0.1:{port}", "--threads", "1",
         *TINY_WORKER],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def recv(timeout: float = 60) -> object:
        assert router.poll(int(timeout * 1000)), (tmp_path / "worker.log").read_text()[-3000:]
        frames = router.recv_multipart()
        return decode(frames[1])

    def recv_kind(kind: type, timeout: float = 60) -> object:
        deadline = time.monotonic() + timeout
        while True:
            message = recv(max(0.1, deadline - time.monotonic()))
            if isinstance(message, kind):
                return message

    @FUZZ
    @given(frames=_junk(tuple(k for k in Kind if k not in (Kind.SHUTDOWN, Kind.HEARTBEAT))))  # those two are orders
    def fuzz(frames: list[bytes]) -> None:
        for frame in frames:
            router.send_multipart([identity, frame])

    try:
        assert router.poll(60_000)
        identity, hello = router.recv_multipart()
        assert isinstance(decode(hello), WorkerHello)
        fuzz()  # before the assignment
        router.send_multipart([identity, encode(Assignment(0, 1, str(tiny_llama_dir), "float32", 16, 64, 8))])
        assert isinstance(recv_kind(WorkerReady), WorkerReady)
        router.send_multipart([identity, encode(Heartbeat(0, 1, 2.0))])  # from now on: silence > 2 s = gone
        fuzz()  # while serving
        router.send_multipart([identity, encode(Heartbeat(0, 2, 2.0))])
        plan = StepPlan(1, cached_requests=[CachedRequest(77, 0, 1)])  # a handle the worker does not hold
        router.send_multipart([identity, encode(plan)])
        error = recv_kind(StepError)
        assert isinstance(error, StepError) and error.step_id == 1
        ids = prompt_ids(9)
        new = NewRequest(3, ids, [], SamplingOptions(temperature=0.0), [0], 0, len(ids))
        router.send_multipart([identity, encode(StepPlan(2, [new]))])
        result = recv_kind(StepResult)
        assert isinstance(result, StepResult) and result.step_id == 2 and len(result.tokens_of(3) or []) == 1
        assert isinstance(recv_kind(Heartbeat, 5), Heartbeat)  # it heartbeats at a quarter of our timeout
        assert worker.poll() is None
        time.sleep(4.5)  # the scenario: silent past twice the timeout, but the connection (libzmq's heartbeats) lives
        assert worker.poll() is None, "a busy scheduler whose connection lives is not gone"
        router.close(linger=0)  # now the scheduler is gone: silent and disconnected
        assert worker.wait(15) == 0, "a worker whose scheduler went silent must exit cleanly"
    finally:
        if worker.poll() is None:
            worker.kill()
        router.close()
        ctx.term()
        log.close()
