"""vllm-router in front of real schedulers: two replicas of a tiny Llama (`llama`, publishing their KV events) and
one tiny Qwen2 (`qwen`); one test puts two SmolLM2 replicas beside the Qwen2.

Routing by model, greedy outputs through the router equal to a replica's own (gRPC, and the OpenAI API with the
official client), NOT_FOUND for other models at the router and at a scheduler, Abort fanned out, Control
(ListReplicas, summed GetStats, Drain), health per model, metrics, TLS and the Control token, retry before the
first token over HTTP, `kv` routing on the llamas' KV events through a replica's restart, live migration off a
replica drained with migrate (also by the preStop of the Kubernetes fleet kit, deploy/k8s/router), and `kill -9`
of one replica under load (the last test: it kills a replica of the shared fleet).
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from minivllm.cluster import REPO, Cluster, RouterProcess, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from settings.process import TOKEN_ENV
from tests.support.clusters import control_stats
from tests.support.k8s import COMMANDS, FLEET, World, fleet_prestop, render
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.ops import (
    NOT_SERVING,
    SERVING,
    TINY_WORKER,
    OpenAIStreams,
    Streams,
    add_worker,
    greedy_ids,
    health_status,
    prompt_ids,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.e2e

# 2: further requests wait (kill test). float32: a recompute (migration) gives the tokens of an undisturbed run.
LLAMA = ["--served-model-name", "llama", "--max-num-seqs", "2", "--dtype", "float32"]
# Seeded streams here must be the same bits whatever shares their batch (a migration, other arrivals).
LLAMA_WORKER = [*TINY_WORKER, "--batch-invariant"]
QWEN = ["--served-model-name", "qwen"]
PROBE = ["--probe-interval", "0.2", "--probe-timeout", "1"]
MOVED_TOKENS = 256  # each OpenAI request's output in the migration test


@dataclass
class Fleet:
    llamas: list[Cluster]
    qwen: Cluster
    router: RouterProcess
    metrics_url: str
    llama_dir: Path
    spawned: list[Cluster]  # everything to kill at the end, replacements too
    kv_ports: list[tuple[int, int]]  # each llama's --kv-events-port and --kv-events-snapshot-port

    def llama_args(self, i: int) -> list[str]:
        """The flags of llama replica `i` (a replacement at its address reuses them)."""
        return llama_args(self.kv_ports[i])

    def restart_llama(self, i: int) -> Cluster:
        """Llama replica `i` again at the same addresses, once its old processes are gone."""
        old = self.llamas[i]
        args = self.llama_args(i)
        self.llamas[i] = Cluster(self.llama_dir, args, LLAMA_WORKER, port=old.port, http=True, http_port=old.http_port)
        self.spawned.append(self.llamas[i])
        self.llamas[i].wait_serving()
        return self.llamas[i]

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.router.channel)

    @property
    def control(self) -> pb_grpc.ControlStub:
        return pb_grpc.ControlStub(self.router.channel)

    def replicas(self) -> dict[str, pb.ReplicaStatus]:
        return {r.address: r for r in self.control.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas}


def llama_args(kv_ports: tuple[int, int]) -> list[str]:
    return [*LLAMA, "--kv-events-port", str(kv_ports[0]), "--kv-events-snapshot-port", str(kv_ports[1])]


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> Iterator[Fleet]:
    kv_ports = [(free_port(), free_port()) for _ in range(2)]
    llamas = [Cluster(tiny_llama_dir, llama_args(ports), LLAMA_WORKER, http=True) for ports in kv_ports]
    qwen = Cluster(tiny_qwen2_dir, QWEN, TINY_WORKER, http=True)
    metrics_port = free_port()
    replicas = [f"{c.address},model=llama,http={http_address(c)}" for c in llamas]
    replicas.append(f"{qwen.address},model=qwen,http={http_address(qwen)}")
    args = ["--routing-strategy", "round_robin", "--metrics-port", str(metrics_port), *PROBE]
    router = RouterProcess(replicas, args, http=True)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    fleet = Fleet(llamas, qwen, router, metrics_url, tiny_llama_dir, [*llamas, qwen], kv_ports)
    try:
        for c in fleet.spawned:
            c.wait_serving()
        router.wait_serving(30)
        wait_for(lambda: all(r.state == "serving" for r in fleet.replicas().values()), 10, "every replica serving")
        yield fleet
    finally:
        router.stop()
        for c in fleet.spawned:
            c.kill()


def http_address(cluster: Cluster) -> str:
    return f"127.0.0.1:{cluster.http_port}"


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)


def tokens(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[int]:
    return [t for delta in stub.Generate(request, timeout=60) for t in delta.token_ids]


def test_routing_by_model_gives_each_models_own_greedy_tokens(fleet: Fleet) -> None:
    direct = {
        "llama": pb_grpc.GenerationStub(fleet.llamas[0].channel),
        "qwen": pb_grpc.GenerationStub(fleet.qwen.channel),
    }
    for seed in range(3):
        expected = {model: tokens(stub, greedy_ids(prompt_ids(seed), 12)) for model, stub in direct.items()}
        assert expected["llama"] != expected["qwen"]  # two different models: the test can tell them apart
        for model in ("llama", "qwen"):
            for _ in range(2):  # round robin: both llama replicas answer
                assert tokens(fleet.stub, greedy_ids(prompt_ids(seed), 12, model=model)) == expected[model], model
        assert tokens(fleet.stub, greedy_ids(prompt_ids(seed), 12)) == expected["llama"]  # the default model
    text = pb.GenerateRequest(prompt="The capital of France", sampling=pb.SamplingParams(max_tokens=8, temperature=0))
    for model in ("llama", "qwen"):
        expected_text = "".join(d.text for d in direct[model].Generate(text, timeout=60))
        client = [sys.executable, "-m", "clients.client", "--port", str(fleet.router.port), "--model",
                  model, "--no-chat", "--max-tokens", "8", "--temperature", "0", "The capital of France"]  # fmt: skip
        out = subprocess.run(client, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith(expected_text), (out.stdout, out.stderr)


def test_other_models_are_not_found_at_the_router_and_at_a_scheduler(fleet: Fleet) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        tokens(fleet.stub, greedy_ids(prompt_ids(0), 4, model="gpt-5"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'gpt-5' is not served here; models: llama, qwen" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        tokens(pb_grpc.GenerationStub(fleet.qwen.channel), greedy_ids(prompt_ids(0), 4, model="llama"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "this server serves 'qwen'" in exc.value.details()
    assert tokens(pb_grpc.GenerationStub(fleet.qwen.channel), greedy_ids(prompt_ids(0), 4, model="qwen"))


def test_abort_is_fanned_out_to_the_replica_that_runs_the_request(fleet: Fleet) -> None:
    request = greedy_ids(prompt_ids(7), 1000, request_id="abort-me", model="qwen")
    streams = Streams(fleet.stub, [request])
    streams.wait_all_started()
    with pytest.raises(grpc.RpcError) as exc:
        tokens(fleet.stub, greedy_ids(prompt_ids(8), 4, request_id="abort-me", model="llama"))
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS  # ids are unique across the replicas
    assert fleet.stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found
    (result,) = streams.join(30)
    assert result.finish_reason == "abort" and 0 < len(result.tokens) < 1000
    assert not fleet.stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found
    with pytest.raises(grpc.RpcError) as exc:
        fleet.stub.Abort(pb.AbortRequest(), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        tokens(fleet.stub, greedy_ids(prompt_ids(8), 4, request_id="x" * 10_000, model="llama"))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in exc.value.details()


def test_control_lists_the_replicas_and_sums_their_stats(fleet: Fleet) -> None:
    for seed in range(4):
        tokens(fleet.stub, greedy_ids(prompt_ids(100 + seed), 4, model="llama"))
    replicas = fleet.replicas()
    assert {a: (r.model, r.state) for a, r in replicas.items()} == {
        fleet.llamas[0].address: ("llama", "serving"),
        fleet.llamas[1].address: ("llama", "serving"),
        fleet.qwen.address: ("qwen", "serving"),
    }
    assert all(replicas[c.address].requests >= 2 and replicas[c.address].ttft_ewma_s > 0 for c in fleet.llamas)
    direct = [pb_grpc.ControlStub(c.channel).GetStats(pb.GetStatsRequest(), timeout=5) for c in fleet.llamas]
    summed = fleet.control.GetStats(pb.GetStatsRequest(model="llama"), timeout=5)
    assert summed.total_blocks == sum(s.total_blocks for s in direct)
    assert summed.prefix_cache_queries == sum(s.prefix_cache_queries for s in direct)
    every = fleet.control.GetStats(pb.GetStatsRequest(), timeout=5)
    qwen = pb_grpc.ControlStub(fleet.qwen.channel).GetStats(pb.GetStatsRequest(), timeout=5)
    assert every.total_blocks == summed.total_blocks + qwen.total_blocks
    for c in fleet.llamas:
        assert metric(fleet.metrics_url, "minivllm:router_requests_total", replica=c.address) >= 2
        assert metric(fleet.metrics_url, "minivllm:router_replica_healthy", replica=c.address) == 1
    assert metric(fleet.metrics_url, "minivllm:router_decisions_total", strategy="round_robin", decision="next") >= 4
    for call, request, code in [
        (fleet.control.GetStats, pb.GetStatsRequest(model="gpt-5"), grpc.StatusCode.NOT_FOUND),
        (fleet.control.ListWorkers, pb.ListWorkersRequest(), grpc.StatusCode.UNIMPLEMENTED),
    ]:
        with pytest.raises(grpc.RpcError) as exc:
            call(request, timeout=5)
        assert exc.value.code() == code


def test_health_needs_a_serving_replica_of_every_model(fleet: Fleet) -> None:
    ghost = f"127.0.0.1:{free_port()},model=ghost"  # nothing listens there
    replicas = [f"{c.address},model=llama" for c in fleet.llamas] + [ghost]
    router = RouterProcess(replicas, PROBE)
    try:
        wait_for(lambda: health_status(router.channel) == NOT_SERVING, 30, "the router answers NOT_SERVING")
        control = pb_grpc.ControlStub(router.channel)
        wait_for(
            lambda: (
                [r.state for r in control.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas]
                == ["serving", "serving", "down"]
            ),
            10,
            "the llamas serving, the ghost down",
        )
        assert health_status(router.channel) == NOT_SERVING
        stub = pb_grpc.GenerationStub(router.channel)
        assert tokens(stub, greedy_ids(prompt_ids(0), 4))  # llama still routes
        with pytest.raises(grpc.RpcError) as exc:
            tokens(stub, greedy_ids(prompt_ids(0), 4, model="ghost"))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "model 'ghost': no replica is serving" in exc.value.details()
        # Drain: the open stream finishes, new requests are refused, and the answer says so.
        streams = Streams(stub, [greedy_ids(prompt_ids(1), 200)])
        streams.wait_all_started()
        drained = control.Drain(pb.DrainRequest(timeout_s=60), timeout=90)
        assert (drained.drained, drained.remaining) == (True, 0)
        (result,) = streams.join(10)
        assert result.finish_reason == "length" and len(result.tokens) == 200
        with pytest.raises(grpc.RpcError) as exc:
            tokens(stub, greedy_ids(prompt_ids(0), 4))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in exc.value.details()
    finally:
        assert router.stop() == 0


def test_router_serves_tls_and_guards_control_with_a_token(fleet: Fleet, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--control-token", "s3cret", *PROBE]
    router = RouterProcess([f"{fleet.llamas[1].address},model=llama"], args)
    router.channel.close()
    router.channel = grpc.secure_channel(router.address, grpc.ssl_channel_credentials(cert.read_bytes()))
    try:
        router.wait_serving(30)
        assert tokens(pb_grpc.GenerationStub(router.channel), greedy_ids(prompt_ids(0), 4))
        with grpc.insecure_channel(router.address) as plain:
            assert health_status(plain) == -1  # a plaintext client gets no answer
        control = pb_grpc.ControlStub(router.channel)
        with pytest.raises(grpc.RpcError) as exc:
            control.ListReplicas(pb.ListReplicasRequest(), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = control.ListReplicas(
            pb.ListReplicasRequest(), timeout=5, metadata=[("authorization", "Bearer s3cret")]
        )
        assert [r.address for r in listed.replicas] == [fleet.llamas[1].address]
    finally:
        assert router.stop() == 0


def test_the_openai_api_through_the_router_routes_by_model_and_streams_through(fleet: Fleet) -> None:
    """The official client against the router's HTTP door: /v1/models lists both models, each model's greedy text
    equals its replica's own door's, streamed chunks arrive while the replica still runs the request (no
    buffering), and errors keep the door's shape and words."""
    client = openai_client(fleet.router.base_url)
    assert sorted(m.id for m in client.models.list().data) == ["llama", "qwen"]
    direct = {"llama": fleet.llamas[0], "qwen": fleet.qwen}
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]
    answers = {}
    for model, cluster in direct.items():
        own = openai_client(cluster.base_url).chat.completions.create(
            model=model, messages=chat, max_tokens=12, temperature=0
        )  # fmt: skip
        for _ in range(2):  # round robin: both llama replicas answer
            routed = client.chat.completions.create(model=model, messages=chat, max_tokens=12, temperature=0)
            assert routed.choices[0].message.content == own.choices[0].message.content, model
            assert routed.usage is not None and own.usage is not None, "a chat completion reports its usage"
            assert routed.model == model and routed.usage.completion_tokens == own.usage.completion_tokens
        answers[model] = own.choices[0].message.content
        text = client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0)
        own_text = openai_client(cluster.base_url).completions.create(
            model=model, prompt="The sea is", max_tokens=6, temperature=0
        )  # fmt: skip
        assert text.choices[0].text == own_text.choices[0].text
        routed_response = client.responses.create(model=model, input="The sea is", max_output_tokens=6, temperature=0)
        own_response = openai_client(cluster.base_url).responses.create(
            model=model, input="The sea is", max_output_tokens=6, temperature=0
        )  # fmt: skip
        assert routed_response.output_text == own_response.output_text and routed_response.model == model
        routed_vector = client.embeddings.create(model=model, input="The sea").data[0].embedding
        own_vector = openai_client(cluster.base_url).embeddings.create(model=model, input="The sea").data[0].embedding
        assert routed_vector == pytest.approx(own_vector, abs=1e-4)  # either llama replica, cached prefix or not
    assert answers["llama"] != answers["qwen"]  # two different models: the test can tell them apart
    stream = client.completions.create(model="qwen", prompt="The sea is", max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    pieces = [next(iter(stream)).choices[0].text]
    assert fleet.replicas()[fleet.qwen.address].in_flight == 1  # the first chunk came before the end of the stream
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) > 100  # one chunk per token (or nearly), not one buffered answer
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    assert not_found.value.code == "model_not_found" and "'gpt-5' is not served here" in not_found.value.message
    for streamed in (False, True):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="llama", prompt="hi", max_tokens=2, temperature=-1, stream=streamed)
        assert bad.value.param == "temperature"  # the replica's door checks the ranges, in its own words
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llama", messages=[{"content": "no role"}], max_tokens=2)  # type: ignore[list-item]
    assert bad.value.param == "messages[0].role"  # the router checks the body with the door's models
    root = fleet.router.base_url.removesuffix("/v1")
    assert httpx.get(root + "/health").status_code == 200
    assert "minivllm:router_requests_total" in httpx.get(root + "/metrics").text
    for model, cluster in direct.items():
        body = {"model": model, "prompt": "The sea is"}
        own = httpx.post(cluster.base_url.removesuffix("/v1") + "/tokenize", json=body).json()
        assert httpx.post(root + "/tokenize", json=body).json() == own
        ids = {"model": model, "tokens": own["tokens"]}
        back = httpx.post(cluster.base_url.removesuffix("/v1") + "/detokenize", json=ids).json()
        assert "The sea is" in back["prompt"] and httpx.post(root + "/detokenize", json=ids).json() == back


def test_an_http_request_that_cannot_reach_its_replica_is_retried_on_another(fleet: Fleet) -> None:
    """Retry before the first token over HTTP: one replica's HTTP port has nothing behind it (its gRPC side is
    healthy, so it stays in the ring); every request still completes on the other, once retried."""
    dead = f"127.0.0.1:{free_port()}"
    replicas = [f"{fleet.llamas[0].address},model=llama,http={dead}",
                f"{fleet.llamas[1].address},model=llama,http={http_address(fleet.llamas[1])}"]  # fmt: skip
    router = RouterProcess(replicas, ["--routing-strategy", "round_robin", *PROBE], http=True)
    try:
        router.wait_serving(30)
        client = openai_client(router.base_url)
        reference = openai_client(fleet.llamas[1].base_url).completions.create(
            model="llama", prompt="The sea is", max_tokens=8, temperature=0
        )  # fmt: skip
        for stream in (False, True, False, True):
            wait_for(lambda: health_status(router.channel) == SERVING, 10, "the router serving")
            answer = client.completions.create(model="llama", prompt="The sea is", max_tokens=8, temperature=0,
                                               stream=stream)  # fmt: skip
            if isinstance(answer, openai.Stream):
                text = "".join(c.choices[0].text for c in answer if c.choices)
            else:
                text = answer.choices[0].text
            assert text == reference.choices[0].text, stream
        retries = metric(router.base_url.replace("/v1", "/metrics"), "minivllm:router_retries_total", model="llama")
        assert retries >= 1
    finally:
        assert router.stop() == 0


def test_an_http_stream_whose_replica_dies_ends_with_an_error_naming_it(fleet: Fleet) -> None:
    """After the first chunk a request is not sent again (the client has tokens): the stream ends with an error
    event naming the replica, which the official client raises; nothing hangs."""
    doomed = Cluster(fleet.llama_dir, LLAMA, TINY_WORKER, http=True)
    fleet.spawned.append(doomed)
    router = RouterProcess([f"{doomed.address},model=llama,http={http_address(doomed)}"], PROBE, http=True)
    try:
        doomed.wait_serving()
        router.wait_serving(30)
        stream = openai_client(router.base_url).completions.create(
            model="llama", prompt="The sea is", max_tokens=1000, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        assert next(chunks).choices
        doomed.scheduler.kill()
        with pytest.raises(openai.APIError) as exc:
            for _ in chunks:
                pass
        assert http_address(doomed) in exc.value.message and "failed mid-stream" in exc.value.message
    finally:
        assert router.stop() == 0
        doomed.kill()


def test_two_smollm2_replicas_and_a_tiny_model_behind_one_router(fleet: Fleet, smollm2_dir: Path) -> None:
    """The issue's fleet with the real model: greedy tokens through the router equal a SmolLM2 replica's own
    (each replica answers in turn), and the tiny model beside it keeps its own."""
    smol = [Cluster(smollm2_dir, ["--served-model-name", "smollm2"], ["--kv-cache-memory", "48MiB"]) for _ in range(2)]
    fleet.spawned += smol
    router = RouterProcess([*(f"{c.address},model=smollm2" for c in smol), f"{fleet.qwen.address},model=qwen"],
                           ["--routing-strategy", "round_robin", *PROBE])  # fmt: skip
    try:
        for c in smol:
            c.wait_serving()
        router.wait_serving(30)
        stub = pb_grpc.GenerationStub(router.channel)
        for seed in range(2):
            text = pb.GenerateRequest(prompt=f"Question {seed}: what is the capital of France? Answer:",
                                      sampling=pb.SamplingParams(max_tokens=8, temperature=0))  # fmt: skip
            expected = [d.text for d in pb_grpc.GenerationStub(smol[0].channel).Generate(text, timeout=60)]
            for _ in range(2):  # round robin: both SmolLM2 replicas answer
                text.model = "smollm2"
                assert [d.text for d in stub.Generate(text, timeout=60)] == expected
            own = tokens(pb_grpc.GenerationStub(fleet.qwen.channel), greedy_ids(prompt_ids(seed), 8))
            assert tokens(stub, greedy_ids(prompt_ids(seed), 8, model="qwen")) == own
        requests = {r.address: r.requests for r in pb_grpc.ControlStub(router.channel).ListReplicas(
            pb.ListReplicasRequest(), timeout=5).replicas}  # fmt: skip
        assert [requests[c.address] for c in smol] == [2, 2]
    finally:
        assert router.stop() == 0
        for c in smol:
            c.stop()


def metric(url: str, name: str, **labels: str) -> float:
    """A sample's value from the Prometheus text, 0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_kv_routing_follows_the_cached_prefix_and_never_a_restarted_replicas_stale_index(fleet: Fleet) -> None:
    """A `kv` router over the two llamas: requests sharing a long prefix all land on the replica that computed it
    (the router's index, fed by its KV events, says it holds the blocks); that replica restarts (a new process,
    an empty cache) and the next such request is routed as if nothing were cached, then follows its new home."""
    metrics_port = free_port()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    replicas = [
        f"{c.address},model=llama,kv_events=127.0.0.1:{events},kv_snapshot=127.0.0.1:{snaps},tokenizer={fleet.llama_dir}"
        for c, (events, snaps) in zip(fleet.llamas, fleet.kv_ports)
    ]
    router = RouterProcess(replicas, ["--routing-strategy", "kv", "--metrics-port", str(metrics_port), *PROBE])
    stub = pb_grpc.GenerationStub(router.channel)
    shared = prompt_ids(4242, 80)  # 5 blocks of 16

    def decisions(decision: str) -> float:
        return metric(url, "minivllm:router_decisions_total", strategy="kv", decision=decision)

    def indexed(cluster: Cluster) -> float:
        return metric(url, "minivllm:router_kv_indexed_blocks", replica=cluster.address)

    def listed() -> list[pb.ReplicaStatus]:
        return list(pb_grpc.ControlStub(router.channel).ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas)

    def served() -> dict[str, int]:
        return {r.address: r.requests for r in listed()}

    def send(suffix: int) -> None:
        """One request of the shared prefix, once the router's polled loads show the last one ended (a stale
        running count is a request ahead, which the cost weighs against the cached blocks)."""
        wait_for(lambda: all(r.num_running + r.num_waiting == 0 for r in listed()), 10, "the router sees idle")
        tokens(stub, greedy_ids(shared + [suffix], 2, model="llama"))

    try:
        router.wait_serving(30)
        send(5)
        assert decisions("least") == 1, "nothing of it was cached anywhere"
        home = next(c for c in fleet.llamas if served()[c.address] == 1)
        wait_for(lambda: indexed(home) >= 5, 10, "the router indexes the blocks its replica stored")
        for i in range(3):
            send(6 + i)
        assert served()[home.address] == 4 and decisions("overlap") == 3

        i = fleet.llamas.index(home)
        home.kill()
        wait_for(lambda: indexed(home) == 0, 10, "the index of a replica that is down is dropped")
        home = fleet.restart_llama(i)
        wait_for(lambda: fleet.replicas()[home.address].state == "serving", 10, "back in the shared router")
        wait_for(lambda: listed()[i].state == "serving", 10, "back in the kv router")
        prior = served()
        send(9)
        assert decisions("least") == 2 and decisions("overlap") == 3, "routed on the restarted replica's old index"
        after = served()
        new_home = next(address for address in after if after[address] > prior[address])
        wait_for(lambda: metric(url, "minivllm:router_kv_indexed_blocks", replica=new_home) >= 5, 10, "indexed")
        send(10)
        assert served()[new_home] == after[new_home] + 1 and decisions("overlap") == 4, "the new home is followed"
    finally:
        router.stop()


def migration_counts(replica: Cluster) -> tuple[int, int, int]:
    """A replica's migrated sequences imported with their KV, recomputed, and KV tokens imported."""
    stats = pb_grpc.ControlStub(replica.channel).GetStats(pb.GetStatsRequest(), timeout=5)
    return stats.migrations_imported, stats.migrations_recomputed, stats.migration_kv_tokens_imported


def test_drain_migrate_moves_running_streams_to_the_other_replica_unnoticed(fleet: Fleet) -> None:
    """Live migration (issue 31): 32 streams through the router, greedy, seeded and n = 2, prompts sharing
    prefixes; a Drain with migrate of one replica mid-stream (its running streams pull their KV, its waiting ones
    start on the other): 32/32 complete with exactly the tokens and usage of an undisturbed run (greedy also
    teacher-forced against HF), the drained replica stops with exit 0, the other ends idle."""
    victim, survivor = fleet.llamas
    max_tokens = 32
    shared = [prompt_ids(3100, 20), prompt_ids(3101, 36)]
    requests = [greedy_ids(shared[i % 2] + prompt_ids(3200 + i, 4), max_tokens, model="llama") for i in range(16)]
    for i in range(16):  # seeded; every fourth samples two sequences (seeds s and s + 1)
        sampling = pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=7 + i, ignore_eos=True, n=1 + i % 4 // 3
        )
        prompt = pb.TokenIds(ids=(shared[i % 2] if i % 3 == 0 else []) + prompt_ids(3300 + i))
        requests.append(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling, model="llama"))
    expected = Streams(pb_grpc.GenerationStub(survivor.channel), requests).join(120)
    try:
        streams = Streams(fleet.stub, requests, timeout=120)
        # Round robin: half on each replica, two running on each (--max-num-seqs 2), the rest waiting there.
        wait_for(lambda: sum(len(r.tokens) >= 2 for r in streams.results) >= 4, 60, "both replicas stream")
        # Under load its requests arrive late: one that comes after the Drain is retried elsewhere, not migrated.
        wait_for(lambda: (s := control_stats(victim)).num_running + s.num_waiting >= 4, 60, "the victim has a queue")
        drained = pb_grpc.ControlStub(victim.channel).Drain(pb.DrainRequest(timeout_s=30, migrate=True), timeout=40)
        assert drained.drained and drained.migrated >= 2, drained  # what it ran and what waited there
        results = streams.join(120)
        hf = load_hf(fleet.llama_dir)
        for i, (request, got, want) in enumerate(zip(requests, results, expected)):
            assert got.code is None, (i, got.code, got.details)
            # no token lost or repeated (on failure: were the moved sequences imported or recomputed?)
            assert got.sequences == want.sequences and got.finish_reason == "length", (i, migration_counts(survivor))
            assert got.completion_tokens == want.completion_tokens == max_tokens * len(want.sequences), i
            if request.sampling.temperature == 0:
                assert_teacher_forced(hf, list(request.prompt_token_ids.ids), got.tokens)
        assert victim.stop() == [0, 0], victim.logs()
        stats = wait_idle(pb_grpc.ControlStub(survivor.channel))
        assert (stats.num_running, stats.num_waiting, stats.used_blocks) == (0, 0, 0), stats
        # The running streams resumed from the KV they left (those that waited there had none: recomputed).
        assert stats.migrations_imported >= 2 and stats.migration_kv_tokens_imported > 0, stats
    finally:  # for the tests after this one, also when this one fails
        victim.stop()
        fleet.restart_llama(0)
        wait_for(lambda: fleet.replicas()[victim.address].state == "serving", 10, "the replica comes back")


def test_drain_migrate_moves_openai_streams_through_the_router_unnoticed(fleet: Fleet) -> None:
    """Live migration of OpenAI requests (issue 31): the official client sends a greedy completion, a seeded one
    with n = 2, a seeded chat (streams) and a greedy completion (not streamed) through the router's HTTP door,
    round robin over both llamas; a Drain with migrate of the one running the n = 2 stream, mid-stream: each
    request completes as one response (one id, one finish_reason per choice, one usage) with the text and usage of
    an undisturbed run, and the moved sequences resumed from the KV they left."""
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story about the sea."}]
    calls = [
        ("completion", {"prompt": prompt_ids(3600, 24), "temperature": 0}),
        ("completion", {"prompt": prompt_ids(3601, 20), "temperature": 0.8, "seed": 7, "n": 2}),
        ("chat", {"messages": chat, "temperature": 0.8, "seed": 3}),
        ("whole", {"prompt": prompt_ids(3602, 16), "temperature": 0}),
    ]
    # 256 tokens: each request still runs when the next is routed (48 ran out between two polls of the router's
    # in-flight counts on an idle Sapphire Rapids).
    common = {"model": "llama", "max_tokens": MOVED_TOKENS, "extra_body": {"ignore_eos": True}}
    direct, routed = openai_client(fleet.llamas[0].base_url), openai_client(fleet.router.base_url)
    expected = OpenAIStreams([(direct, kind, {**common, **args}) for kind, args in calls]).join(120)
    streams: list[OpenAIStreams] = []
    placed: list[Cluster] = []  # one at a time, each request's replica: round robin alternates
    for kind, args in calls:
        was = {c.address: fleet.replicas()[c.address].in_flight for c in fleet.llamas}
        streams.append(OpenAIStreams([(routed, kind, {**common, **args})]))
        wait_for(lambda: sum(r.in_flight for r in fleet.replicas().values()) == len(streams), 30, "routed")
        placed.append(next(c for c in fleet.llamas if fleet.replicas()[c.address].in_flight > was[c.address]))
    victim = placed[1]  # the n = 2 stream and the unstreamed completion (--max-num-seqs 2: one of them waits)
    assert placed == [placed[0], victim, placed[0], victim] and placed[0] is not victim, placed
    survivor = next(c for c in fleet.llamas if c is not victim)
    before = control_stats(survivor)
    try:
        wait_for(lambda: streams[1].results[0].chunks >= 3, 60, "the n = 2 stream is under way")
        # The router counts a request in flight when it sends it; under load the unstreamed one reached the
        # victim's engine only after a drain (then it was refused there and retried, not migrated).
        wait_for(lambda: control_stats(victim).num_waiting == 1, 30, "the unstreamed completion waits on the victim")
        drained = pb_grpc.ControlStub(victim.channel).Drain(pb.DrainRequest(timeout_s=30, migrate=True), timeout=40)
        assert drained.drained and drained.migrated == 2, drained
        for i, (stream, want) in enumerate(zip(streams, expected)):
            [got] = stream.join(120)
            assert not got.error and not want.error, (i, got.error, want.error)
            assert got.texts == want.texts and len(got.ids) == 1, i  # no token lost or repeated, one response
            assert got.finishes == want.finishes == {c: ["length"] for c in want.texts}, i
            assert got.usage is not None and want.usage is not None
            usage = got.usage.prompt_tokens, got.usage.completion_tokens
            assert usage == (want.usage.prompt_tokens, MOVED_TOKENS * len(want.texts)), (i, got.usage)
        assert victim.stop() == [0, 0], victim.logs()
        stats = wait_idle(pb_grpc.ControlStub(survivor.channel))
        assert (stats.num_running, stats.num_waiting, stats.used_blocks) == (0, 0, 0), stats
        # Each moved sequence counted once where it resumed: the n = 2 pair from the KV it left on the victim (both
        # pull on arrival, though the survivor's seats are taken), the completion that waited there by recompute.
        imported = stats.migrations_imported - before.migrations_imported
        assert (imported, stats.migrations_recomputed - before.migrations_recomputed) == (2, 1), stats
    finally:  # the tests after this one need both llamas (and none of these streams), also when this one fails
        victim.stop()
        for thread in (t for stream in streams for t in stream.threads):
            thread.join(60)  # not join(): its assertion would hide this test's failure
        fleet.restart_llama(fleet.llamas.index(victim))
        wait_for(lambda: fleet.replicas()[victim.address].state == "serving", 10, "the replica comes back")


def test_the_k8s_fleets_prestop_migrates_a_replicas_streams_and_it_exits_0(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rolling-upgrade step of deploy/k8s/router (issue 31): the preStop command taken from the rendered
    manifest (`vllm-client drain --migrate ...`, pointed at the replica's port instead of the pod's 50051) runs
    against one llama mid-stream, then SIGTERM as the kubelet sends it: the streams complete with the tokens of
    an undisturbed run, the moved ones resumed on the other llama, the hook exits 0 and so does the replica. The
    hook runs vllm-client's own main in this process: a new process's start-up could outlast the streams."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    prestop = fleet_prestop(World(render(FLEET)))
    assert prestop[0] == "vllm-client" and "--migrate" in prestop, prestop
    monkeypatch.delenv(TOKEN_ENV, raising=False)  # the pod's token; the fleet's replicas have none
    victim, survivor = fleet.llamas
    requests = [greedy_ids(prompt_ids(3700 + i, 12), 96, model="llama") for i in range(2)]
    sampling = pb.SamplingParams(max_tokens=96, temperature=0.8, seed=11, ignore_eos=True)
    requests += [pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids(3710 + i)), sampling=sampling,
                                    model="llama") for i in range(2)]  # fmt: skip
    expected = Streams(pb_grpc.GenerationStub(survivor.channel), requests).join(120)
    before = sum(migration_counts(survivor)[:2])
    try:
        streams = Streams(fleet.stub, requests, timeout=120)
        wait_for(lambda: all(len(r.tokens) >= 2 for r in streams.results), 60, "every stream is under way")
        assert control_stats(victim).num_running == 2, "round robin: two of the four run on the victim"
        capsys.readouterr()
        code = importlib.import_module(COMMANDS[prestop[0]]).main([*prestop[1:], "--port", str(victim.port)])
        assert code == 0 and capsys.readouterr().out.strip() == "drained"
        assert victim.stop() == [0, 0], victim.logs()  # SIGTERM after the preStop: nothing left to wait for
        for i, (got, want) in enumerate(zip(streams.join(120), expected)):
            assert got.code is None, (i, got.code, got.details)
            assert got.sequences == want.sequences and got.finish_reason == "length", (i, migration_counts(survivor))
        assert sum(migration_counts(survivor)[:2]) == before + 2, "the victim's two streams moved"
    finally:  # the tests after this one need both llamas
        victim.stop()
        fleet.restart_llama(0)
        wait_for(lambda: fleet.replicas()[victim.address].state == "serving", 10, "the replica comes back")


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_rebalance_moves_a_long_runner_off_a_long_queue_to_the_idle_replica_unnoticed(
    fleet: Fleet, seeded: bool
) -> None:
    """`vllm-router --rebalance` (issue 31) over the two llamas: a stream through it runs on one of them, whose
    queue then fills with requests sent to it directly (--max-num-seqs 2: one runs beside the stream, two wait)
    while the other idles: the router moves the stream there (Control.Migrate), its KV pulled, and the client gets
    the tokens of an undisturbed run (greedy: teacher-forced against HF) in one stream; the source, which serves
    on, frees its lease once the target answered. Seeded (seed 5, temperature 0.8): before the llamas ran with
    --batch-invariant, the moved stream parted from its undisturbed run at output 107 in 7 runs of 19 (its
    logits moved by ~1e-6 with what shared its batch, and a draw near a CDF boundary flipped)."""
    prompt = prompt_ids(3700 if seeded else 3750, 24)
    request = greedy_ids(prompt, 256, model="llama")
    if seeded:
        request.sampling.temperature, request.sampling.seed = 0.8, 5
    router = RouterProcess([f"{c.address},model=llama" for c in fleet.llamas], ["--rebalance", *PROBE])
    try:
        expected = Streams(pb_grpc.GenerationStub(fleet.llamas[1].channel), [request]).join(120)[0]
        router.wait_serving(30)
        control = pb_grpc.ControlStub(router.channel)

        def idle_llamas() -> bool:
            replicas = control.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas
            return all(r.state == "serving" and not r.num_running and not r.num_waiting for r in replicas)

        wait_for(idle_llamas, 10, "the router sees both llamas idle")
        routed = Streams(pb_grpc.GenerationStub(router.channel), [request])
        wait_for(lambda: len(routed.results[0].tokens) >= 2, 60, "the stream runs")
        home, idle = sorted(fleet.llamas, key=lambda c: -control_stats(c).num_running)
        before = migration_counts(idle)
        fillers = [greedy_ids(prompt_ids(3760 + i, 8), 256) for i in range(3)]
        queue = Streams(pb_grpc.GenerationStub(home.channel), fillers)
        [got] = routed.join(120)
        queue.join(120)
        assert got.code is None and got.finish_reason == "length", (got.code, got.details)
        assert got.tokens == expected.tokens and got.completion_tokens == 256
        if not seeded:
            assert_teacher_forced(load_hf(fleet.llama_dir), prompt, got.tokens)
        imported, recomputed, _ = migration_counts(idle)
        assert (imported - before[0], recomputed - before[1]) == (1, 0), "moved, from the KV it left"
        for c in fleet.llamas:  # the source freed the lease once the target answered
            stats = wait_idle(pb_grpc.ControlStub(c.channel))
            assert (stats.num_running, stats.num_waiting, stats.used_blocks) == (0, 0, 0), (c.address, stats)
    finally:
        router.stop()


def test_drain_migrate_with_its_target_killed_runs_the_streams_on_where_their_kv_is(fleet: Fleet) -> None:
    """A target killed mid-migration (issue 31): the other llama is killed (kill -9) under load, then the first is
    drained with migrate. Its streams come back to the router, whose only target is dead (UNAVAILABLE before a
    first token, or already out of the serving set): the router sends them back to the draining replica, which
    still holds their KV and runs them on. Every stream that did not run on the killed replica completes with the
    tokens of an undisturbed run; none hangs."""
    source, target = fleet.llamas
    try:
        requests = [greedy_ids(prompt_ids(3400 + i, 12), 64, model="llama") for i in range(3)]
        sampling = pb.SamplingParams(max_tokens=64, temperature=0.8, seed=3, ignore_eos=True, n=2)
        requests.append(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids(3500)), sampling=sampling))
        expected = Streams(pb_grpc.GenerationStub(source.channel), requests).join(120)
        streams = Streams(fleet.stub, requests, timeout=120)
        wait_for(lambda: sum(len(r.tokens) >= 2 for r in streams.results) >= 3, 60, "both replicas stream")
        target.kill()  # kill -9: its scheduler and workers
        drained = pb_grpc.ControlStub(source.channel).Drain(pb.DrainRequest(timeout_s=30, migrate=True), timeout=40)
        assert drained.migrated >= 1, drained
        results = streams.join(120)
        cut = f"replica {target.address} "  # how the router ends a stream its replica died under
        on_source = [i for i, r in enumerate(results) if not (r.code is not None and r.details.startswith(cut))]
        assert on_source, "some streams ran on the drained replica"
        for i in on_source:
            got, want = results[i], expected[i]
            assert got.code is None, (i, got.code, got.details)
            assert got.sequences == want.sequences and got.finish_reason == "length", i  # none lost or repeated
        stats = wait_idle(pb_grpc.ControlStub(source.channel))
        assert (stats.num_running, stats.num_waiting, stats.used_blocks) == (0, 0, 0), stats  # its leases released
        assert source.stop() == [0, 0], source.logs()
    finally:  # the tests after this one need both llamas, whatever happened here
        for i, cluster in enumerate(fleet.llamas):
            cluster.kill()
            fleet.restart_llama(i)
    wait_for(lambda: all(r.state == "serving" for r in fleet.replicas().values()), 10, "both llamas come back")


def test_disaggregated_prefill_then_decode_and_no_lease_left_after_a_cancel(fleet: Fleet) -> None:
    """A router with --disaggregate over the two llamas, one kv_role=prefill and one kv_role=decode: greedy tokens
    equal a replica's own over gRPC and the OpenAI API, the decode replica pulls the prompt's full blocks (its
    cached tokens), streams
    cancelled at once or after their first token and a kill -9 of the decode worker after the import leave no
    block leased or used on either replica."""
    prefill, decode = fleet.llamas
    replicas = [
        f"{prefill.address},model=llama,kv_role=prefill,http={http_address(prefill)}",
        f"{decode.address},model=llama,kv_role=decode,http={http_address(decode)}",
    ]
    router = RouterProcess(replicas, ["--disaggregate", *PROBE], http=True)
    try:
        router.wait_serving(30)
        stub = pb_grpc.GenerationStub(router.channel)
        for seed in (101, 102):
            ids = prompt_ids(seed, 70)
            expected = tokens(pb_grpc.GenerationStub(prefill.channel), greedy_ids(ids, 10))
            responses = list(stub.Generate(greedy_ids(ids, 10), timeout=60))
            assert [t for r in responses for t in r.token_ids] == expected
            assert responses[-1].usage.cached_tokens == 64, "4 full blocks pulled from the prefill replica"
        openai_handoff(router, prefill)
        at_once = stub.Generate(greedy_ids(prompt_ids(103, 70), 200), timeout=60)
        at_once.cancel()
        later = stub.Generate(greedy_ids(prompt_ids(104, 70), 200), timeout=60)
        next(later)
        later.cancel()

        def used(c: Cluster) -> int:
            return pb_grpc.ControlStub(c.channel).GetStats(pb.GetStatsRequest(), timeout=5).used_blocks

        wait_for(lambda: used(prefill) == 0 and used(decode) == 0, 30, "no block leased or used on either replica")
        decode_worker_killed_after_import(prefill, decode, stub)
        wait_for(lambda: used(prefill) == 0 and used(decode) == 0, 30, "no block leased or used after the kill")
    finally:
        router.stop()


def openai_handoff(router: RouterProcess, prefill: Cluster) -> None:
    """The OpenAI door through the disaggregating router: a completion and a streamed chat give the prefill
    replica's own text, the decode replica having pulled the prompt's full blocks (its cached tokens)."""
    client, own = openai_client(router.base_url), openai_client(prefill.base_url)
    prompt = prompt_ids(105, 70)
    kw: dict = {"model": "llama", "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    done = client.completions.create(prompt=prompt, **kw)
    assert done.choices[0].text == own.completions.create(prompt=prompt, **kw).choices[0].text
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 64, "4 full blocks pulled from the prefill replica"
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea. " * 12}]
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(messages=chat, stream=True, **kw)
              if c.choices]  # fmt: skip
    assert "".join(pieces) == own.chat.completions.create(messages=chat, **kw).choices[0].message.content


def decode_worker_killed_after_import(prefill: Cluster, decode: Cluster, stub: pb_grpc.GenerationStub) -> None:
    """kill -9 of the decode replica's worker once every stream imported its prompt's KV (it streams): a
    replacement joins and each stream completes with exactly its tokens (recomputed; the lease was used once)."""
    max_tokens = 300
    prompts = [prompt_ids(110 + i, 70) for i in range(2)]  # --max-num-seqs 2: both run on the decode replica
    expected = [tokens(pb_grpc.GenerationStub(prefill.channel), greedy_ids(p, max_tokens)) for p in prompts]
    streams = Streams(stub, [greedy_ids(p, max_tokens) for p in prompts], timeout=180)
    streams.wait_all_started()
    decode.workers[0].kill()
    assert min(len(r.tokens) for r in streams.results) < max_tokens, "the streams ended before the kill"
    add_worker(decode, "replacement", TINY_WORKER)
    for r, want in zip(streams.join(180), expected, strict=True):
        assert (r.code, r.finish_reason) == (None, "length") and r.tokens == want, r.details
    wait_for(lambda: health_status(decode.channel) == SERVING, 30, "the decode replica serves again")


def test_kill_9_of_a_replica_under_load(fleet: Fleet) -> None:
    """Requests waiting on the killed replica (no token yet) finish on the other with the right tokens; those it
    was running end with UNAVAILABLE naming it; nothing hangs; the replica leaves, and returns once restarted."""
    victim, survivor = fleet.llamas
    max_tokens = 300
    prompts = [prompt_ids(200 + i) for i in range(8)]
    expected = [r.tokens for r in Streams(pb_grpc.GenerationStub(survivor.channel),
                                          [greedy_ids(p, max_tokens) for p in prompts]).join(120)]  # fmt: skip
    retries_before = metric(fleet.metrics_url, "minivllm:router_retries_total", model="llama")
    streams = Streams(fleet.stub, [greedy_ids(p, max_tokens, model="llama") for p in prompts], timeout=120)
    # Round robin: 4 on each replica, 2 running and 2 waiting on each (--max-num-seqs 2).
    wait_for(lambda: sum(bool(r.tokens) for r in streams.results) >= 4, 60, "both replicas stream")
    victim.scheduler.kill()
    started = [bool(r.tokens) for r in streams.results]
    results = streams.join(120)
    for i, (r, had_tokens) in enumerate(zip(results, started)):
        if r.code is None:
            assert r.finish_reason == "length" and r.tokens == expected[i], i  # no duplicate or lost token
        else:
            assert had_tokens, f"request {i} had no token yet, so it should have been retried: {r.details}"
            assert r.code == grpc.StatusCode.UNAVAILABLE and victim.address in r.details, (r.code, r.details)
    assert any(r.code == grpc.StatusCode.UNAVAILABLE for r in results), "the victim ran none of them"
    assert all(r.code is None for r, had in zip(results, started) if not had)
    assert metric(fleet.metrics_url, "minivllm:router_retries_total", model="llama") > retries_before
    wait_for(lambda: fleet.replicas()[victim.address].state in ("down", "not_serving"), 5, "the victim leaves")
    assert health_status(fleet.router.channel) == SERVING  # a llama replica is left
    assert metric(fleet.metrics_url, "minivllm:router_replica_healthy", replica=victim.address) == 0
    assert tokens(fleet.stub, greedy_ids(prompts[0], 8, model="llama")) == expected[0][:8]

    victim.kill()  # its worker, too
    fleet.restart_llama(0)  # the same address again
    wait_for(lambda: fleet.replicas()[victim.address].state == "serving", 10, "the replica comes back")
    before = fleet.replicas()[victim.address].requests
    for seed in range(4):
        tokens(fleet.stub, greedy_ids(prompt_ids(seed), 4, model="llama"))
    assert fleet.replicas()[victim.address].requests > before
