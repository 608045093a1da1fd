"""A real scheduler and worker as subprocesses, driven through gRPC like any client would."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from minivllm.cluster import Cluster
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.clusters import serving
from tests.support.ops import wait_idle

pytestmark = pytest.mark.e2e

KV_MEMORY = "48MiB"  # ~68 blocks of 16 tokens on SmolLM2 in float32 (~136 in bf16): max_model_len ~1000 (2000)


@pytest.fixture(scope="module")
def cluster(smollm2_dir: Path) -> Iterator[Cluster]:
    """A world of its own: SmolLM2 itself, whose answers read as text."""
    with serving(Cluster(smollm2_dir, ["--max-num-batched-tokens", "64"], ["--kv-cache-memory", KV_MEMORY])) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster: Cluster) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(cluster.channel)


@pytest.fixture(scope="module")
def control(cluster: Cluster) -> pb_grpc.ControlStub:
    return pb_grpc.ControlStub(cluster.channel)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(smollm2_dir)


def greedy(prompt: str, max_tokens: int, **sampling) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
    return pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    )


def collect(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=120))


def test_health_and_reflection(cluster: Cluster) -> None:
    health = health_pb2_grpc.HealthStub(cluster.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="minivllm.v1.Generation"), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"minivllm.v1.Generation", "minivllm.v1.Control", "grpc.health.v1.Health"} <= names


def test_concurrent_streams_join_to_their_text(stub, control, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [
        "The capital of France is",
        "List three colors:",
        "1, 2, 3, 4,",
        "Write a haiku about the sea.",
    ]
    results: dict[int, list[pb.GenerateResponse]] = {}

    def run(i: int) -> None:
        results[i] = collect(stub, greedy(prompts[i], 12 + 9 * i, ignore_eos=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        deltas = results[i]
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == 12 + 9 * i
        assert "".join(d.text for d in deltas) == tokenizer.decode(tokens)
        assert [d.finish_reason for d in deltas[:-1]] == [""] * (len(deltas) - 1)
        last = deltas[-1]
        assert last.finish_reason == "length"
        assert last.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert last.usage.completion_tokens == len(tokens)
    assert wait_idle(control).free_blocks == wait_idle(control).total_blocks


def test_stop_string_is_cut_exactly(stub) -> None:  # type: ignore[no-untyped-def]
    full = "".join(d.text for d in collect(stub, greedy("Count: one, two, three,", 24, ignore_eos=True)))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    deltas = collect(stub, greedy("Count: one, two, three,", 24, ignore_eos=True, stop=[stop]))
    assert "".join(d.text for d in deltas) == full[: full.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_chat_messages_use_the_template(stub, tokenizer) -> None:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=8, temperature=0.0))
    request.messages.messages.add(role="user", content="Hi!")
    deltas = collect(stub, request)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert deltas[-1].usage.prompt_tokens == len(expected)
    assert deltas[-1].request_id  # the server assigned one


def test_abort_mid_stream_frees_blocks(stub, control) -> None:  # type: ignore[no-untyped-def]
    request = greedy("Tell me a very long story.", 400, ignore_eos=True)
    request.request_id = "to-abort"
    stream = stub.Generate(request, timeout=120)
    first = next(stream)
    assert first.finish_reason == ""
    assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5).found
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens < 400
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5).found
    stats = wait_idle(control)
    assert stats.free_blocks == stats.total_blocks


def test_client_cancel_aborts_and_frees_blocks(stub, control) -> None:  # type: ignore[no-untyped-def]
    stream = stub.Generate(greedy("Once upon a time", 400, ignore_eos=True), timeout=120)
    next(stream)
    assert control.GetStats(pb.GetStatsRequest(), timeout=5).used_blocks > 0
    stream.cancel()
    stats = wait_idle(control)
    assert (stats.num_running, stats.free_blocks) == (0, stats.total_blocks)


def test_duplicate_live_request_id_is_rejected(stub) -> None:  # type: ignore[no-untyped-def]
    request = greedy("A long one", 300, ignore_eos=True)
    request.request_id = "dup"
    first = stub.Generate(request, timeout=120)
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, request)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()


def _bad_requests(max_model_len: int) -> list[tuple[pb.GenerateRequest, str]]:
    def with_sampling(**kw) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
        return pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(**kw))

    return [
        (pb.GenerateRequest(prompt=""), "prompt"),
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "prompt_token_ids"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 10**6])), "prompt_token_ids"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-1])), "prompt_token_ids"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[7] * max_model_len)), "prompt_token_ids"),
        (pb.GenerateRequest(prompt="word " * max_model_len), "prompt"),
        (pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
        (pb.GenerateRequest(prompt="hello", kv_precision="bogus"), "kv_precision"),
        (pb.GenerateRequest(prompt="hello", kv_precision="compact"), "kv_precision"),  # no compact pool here
        (with_sampling(max_tokens=0), "sampling.max_tokens"),
        (with_sampling(max_tokens=max_model_len), "sampling.max_tokens"),
        (with_sampling(temperature=-0.5), "sampling.temperature"),
        (with_sampling(temperature=float("nan")), "sampling.temperature"),
        (with_sampling(top_p=0.0), "sampling.top_p"),
        (with_sampling(top_p=1.5), "sampling.top_p"),
        (with_sampling(top_k=-2), "sampling.top_k"),
        (with_sampling(n=0), "sampling.n"),
        (with_sampling(logprobs=-1), "sampling.logprobs"),
        (with_sampling(min_p=1.5), "sampling.min_p"),
        (with_sampling(repetition_penalty=0.0), "sampling.repetition_penalty"),
        (with_sampling(frequency_penalty=2.5), "sampling.frequency_penalty"),
        (with_sampling(presence_penalty=float("nan")), "sampling.presence_penalty"),
        (with_sampling(max_tokens=4, min_tokens=5), "sampling.min_tokens"),
        (with_sampling(stop_token_ids=[10**6]), "sampling.stop_token_ids"),
        (with_sampling(logit_bias={10**6: 1.0}), "sampling.logit_bias"),
        (with_sampling(logit_bias={5: 500.0}), "sampling.logit_bias"),
        (with_sampling(bad_words=["  "]), "sampling.bad_words"),
        (with_sampling(prompt_logprobs=21), "sampling.prompt_logprobs"),
        (with_sampling(json='{"type": "objectx"}'), "sampling.structured.json"),
        (with_sampling(json="{not json"), "sampling.structured.json"),
        (with_sampling(regex="(ab"), "sampling.structured.regex"),
        (with_sampling(choice=pb.Choices()), "sampling.structured.choice"),
    ]


def test_bad_input_names_the_field_and_server_keeps_serving(stub, control) -> None:  # type: ignore[no-untyped-def]
    max_model_len = control.GetStats(pb.GetStatsRequest(), timeout=5).max_model_len
    for request, field in _bad_requests(max_model_len):
        with pytest.raises(grpc.RpcError) as err:
            collect(stub, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, err.value.details())
        assert err.value.details().startswith(field + ":"), (field, err.value.details())
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(pb.AbortRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert collect(stub, greedy("Still alive?", 3))[-1].finish_reason in ("length", "stop")


def test_logprobs_and_seeded_sampling(stub) -> None:  # type: ignore[no-untyped-def]
    def sampled(seed: int) -> list[int]:
        request = pb.GenerateRequest(
            prompt="Pick a random word:",
            sampling=pb.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True),
        )
        return [t for d in collect(stub, request) for t in d.token_ids]

    assert sampled(3) == sampled(3)
    assert sampled(3) != sampled(4)
    deltas = collect(stub, greedy("The sky is", 4, logprobs=3))
    lps = [lp for d in deltas for lp in d.logprobs]
    assert len(lps) == 4
    for lp in lps:
        assert len(lp.top) == 3 and lp.logprob <= 0
        assert abs(lp.top[0].logprob - lp.logprob) < 1e-4  # greedy: the sampled token is the best one


def test_structured_output_and_prompt_logprobs(stub, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A JSON schema and a choice over gRPC; prompt logprobs arrive once, on the first message."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    sampling = pb.SamplingParams(max_tokens=16, temperature=1.0, seed=1, json=json.dumps(schema), prompt_logprobs=1)
    deltas = collect(stub, pb.GenerateRequest(prompt="Answer in JSON:", sampling=sampling))
    assert json.loads("".join(d.text for d in deltas)) in ({"ok": True}, {"ok": False})
    assert [len(d.prompt_logprobs) for d in deltas if d.prompt_logprobs] == [
        len(tokenizer.encode("Answer in JSON:")) - 1
    ]
    choice = pb.SamplingParams(max_tokens=8, temperature=1.0, seed=2, choice=pb.Choices(choices=["cat", "dog"]))
    deltas = collect(stub, pb.GenerateRequest(prompt="A pet:", sampling=choice))
    assert "".join(d.text for d in deltas) in ("cat", "dog") and deltas[-1].finish_reason == "stop"


def test_n_sequences_stream_with_their_index(stub) -> None:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(
        prompt="Name a fruit:",
        sampling=pb.SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, ignore_eos=True),
    )
    deltas = collect(stub, request)
    finished = [d.index for d in deltas if d.finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_priority_header_must_be_an_integer(stub) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(greedy("hi", 2), timeout=30, metadata=[("x-priority", "urgent")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("priority:")
    deltas = list(stub.Generate(greedy("hi", 2), timeout=30, metadata=[("x-priority", "90")]))
    assert deltas[-1].finish_reason in ("length", "stop")
