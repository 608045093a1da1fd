"""The OpenAI HTTP door of a real scheduler + worker, driven by the official `openai` package (sync and async):
chat and completions, streamed and not, n, stop, logprobs, usage, every error status; greedy output equal to
the gRPC door's token for token; clients that drop mid-stream free every block."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from clients.monitor import readings
from minivllm.cluster import REPO, Cluster, free_port
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from scheduler_node.api.openai_server import MAX_BODY_BYTES
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.clusters import SHARED, MeteredCluster
from tests.support.clusters import control_stats as stats
from tests.support.ops import wait_for

pytestmark = pytest.mark.e2e

KEY = SHARED.api_key
MODEL = SHARED.served_model_name
MAX_WAITING = SHARED.max_waiting_requests
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def cluster(shared_cluster: MeteredCluster) -> MeteredCluster:
    return shared_cluster  # the shared world (tests/support/clusters.py)


@pytest.fixture
def client(cluster: MeteredCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_llama_dir)


def async_client(cluster: Cluster, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.base_url, api_key=key, max_retries=0, timeout=60)


def root(cluster: Cluster) -> str:
    return f"http://127.0.0.1:{cluster.http_port}"


def wait_all_free(cluster: Cluster) -> pb.Stats:
    wait_for(lambda: stats(cluster).num_running + stats(cluster).num_waiting == 0, 60, "the server is idle")
    return stats(cluster)


def families(scrape: str) -> set[str]:
    return {line.split()[2] for line in scrape.splitlines() if line.startswith("# TYPE")}


def test_models_health_metrics_and_tokenize(cluster: MeteredCluster, client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(root(cluster) + "/health").status_code == 200  # open without the key (probes)
    scrape = httpx.get(root(cluster) + "/metrics").text
    assert 'vllm:num_requests_running{model_name="tiny"}' in scrape
    own_port = httpx.get(cluster.metrics_url).text
    assert families(scrape) == families(own_port) and len(families(scrape)) > 20  # one registry, two doors
    assert readings(scrape, ["vllm:kv_cache_usage_perc"])["vllm:kv_cache_usage_perc"]  # what vllm-monitor reads
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "Hello there, world"
    got = httpx.post(root(cluster) + "/tokenize", json={"prompt": text}, headers=auth).json()
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    chat = httpx.post(root(cluster) + "/tokenize", json={"messages": CHAT}, headers=auth).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT)
    back = httpx.post(root(cluster) + "/detokenize", json={"tokens": got["tokens"]}, headers=auth).json()
    assert back == {"prompt": text}


def test_greedy_chat_equals_grpc_token_for_token(cluster: Cluster, client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    request.messages.messages.add(**CHAT[0])
    deltas = list(pb_grpc.GenerationStub(cluster.channel).Generate(request, timeout=60))
    grpc_ids = [t for d in deltas for t in d.token_ids]
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None, "logprobs=True asks for each token's"
    content = logprobs.content
    assert [c.token for c in content] == [tokenizer.token_text(t) for t in grpc_ids]
    assert answer.choices[0].message.content == "".join(d.text for d in deltas)
    assert answer.usage is not None, "a chat completion reports its usage"
    assert answer.usage.prompt_tokens == len(tokenizer.apply_chat_template(CHAT))
    assert answer.usage.completion_tokens == 24 and answer.choices[0].finish_reason == "length"


def test_streamed_chat_joins_to_the_answer_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage, full_usage = chunks[-1].usage, full.usage
    assert not chunks[-1].choices and usage is not None and full_usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (full_usage.prompt_tokens, full_usage.completion_tokens)
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens, "the same prompt just ran: its full blocks are cached"
    assert all(c.usage is None for c in chunks[:-1])


def test_async_completions_n_prompts_and_token_ids(cluster: Cluster, tokenizer) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = async_client(cluster)
        ids = tokenizer.encode("1, 2, 3,")
        many = await client.completions.create(
            model=MODEL, prompt=["1, 2, 3,", "a b c"], n=2, max_tokens=6, temperature=1.0, seed=7,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in many.choices] == [0, 1, 2, 3]
        assert many.usage is not None, "a completion reports its usage"
        assert many.usage.prompt_tokens == len(ids) + len(tokenizer.encode("a b c"))  # once per prompt, not per n
        assert many.usage.completion_tokens == 4 * 6
        by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
        by_text = await client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text
        stream = await client.completions.create(model=MODEL, prompt=[ids, ids], n=2, max_tokens=6, temperature=0,
                                                 stream=True)  # fmt: skip
        texts = ["", "", "", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [by_ids.choices[0].text] * 4  # greedy: every sequence the same
        await client.close()

    asyncio.run(main())


def test_stop_string_is_cut_exactly(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    stop = next(full[i : i + 2] for i in range(len(full) // 2, len(full)) if full[i : i + 2].strip())
    cut = client.completions.create(**kwargs, stop=[stop, "never-seen"]).choices[0]  # type: ignore[call-overload]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_logprobs_in_both_shapes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    chat_logprobs = chat.choices[0].logprobs
    assert chat_logprobs is not None and chat_logprobs.content is not None, "logprobs=True asks for each token's"
    for token in chat_logprobs.content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: the sampled token is the most likely
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob >= token.top_logprobs[2].logprob
    done = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=5, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None, "logprobs=2 asks for them"
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(
        len(top) <= 2 and max(top.values()) == pytest.approx(p) for top, p in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == done.choices[0].text
    assert client.completions.create(model=MODEL, prompt="The sea", max_tokens=2).choices[0].logprobs is None


def test_sampling_extensions_and_structured_output(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    sea = tokenizer.encode(" sea")[0]
    biased = client.completions.create(model=MODEL, prompt="The", max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={str(sea): 100})  # fmt: skip
    biased_logprobs = biased.choices[0].logprobs
    assert biased_logprobs is not None, "logprobs=0 still asks for the sampled tokens"
    assert biased_logprobs.tokens == [tokenizer.token_text(sea)] * 4
    picked = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=3,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})  # fmt: skip
    assert picked.choices[0].message.content in ("yes", "no")
    digits = client.completions.create(model=MODEL, prompt="Code:", max_tokens=8, temperature=1.0, seed=4,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})  # fmt: skip
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )  # fmt: skip
    verdict = answer.choices[0].message.content
    assert verdict is not None, "a json_schema answer has content"
    assert isinstance(json.loads(verdict)["ok"], bool)
    ids = tokenizer.encode("The sea is deep")
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2, "min_tokens": 1})  # fmt: skip
    extra = scored.choices[0].model_extra
    assert extra is not None, "prompt_logprobs is an extension field: it arrives in model_extra"
    prompt_logprobs = extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for token, entry in zip(ids[1:], prompt_logprobs[1:]):
        assert str(token) in entry and entry[str(token)]["decoded_token"] == tokenizer.token_text(token)
        ranked = sorted((e for e in entry.values() if e["rank"]), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]


def bad_status(call, status: type[openai.APIStatusError]) -> openai.APIStatusError:  # type: ignore[no-untyped-def]
    with pytest.raises(status) as err:
        call()
    return err.value


def test_error_statuses_and_shapes(cluster: Cluster, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create
    # deliberately invalid requests (Any: past the client's types), each with the field the door must name
    invalid: list[tuple[dict[str, Any], str]] = [
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(max_completion_tokens=10**6), "max_completion_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(seed=2**70), "seed"),  # wider than the wire's int64
        (dict(top_logprobs=2), "top_logprobs"),  # without logprobs: true
        (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
        (dict(messages=[]), "messages"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages[0].content[0].image_url",
        ),  # fmt: skip  (a text-only model takes no images: the part is named)
        (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
        (dict(frequency_penalty=3), "frequency_penalty"),
        (dict(logit_bias={"abc": 1}), "logit_bias.abc"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
            "response_format",
        ),  # fmt: skip
        (
            dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
            "structured_outputs",
        ),  # fmt: skip
        (dict(tools=[{"type": "function"}]), "tools[0].function"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice="required",
                response_format={"type": "json_object"},
            ),
            "tool_choice",
        ),  # fmt: skip
        (dict(extra_body={"min_p": 2}), "min_p"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (dict(extra_body={"top_k": -5}), "top_k"),
        (dict(extra_body={"kv_precision": "bogus"}), "kv_precision"),
        (dict(extra_body={"kv_precision": "compact"}), "kv_precision"),  # this server keeps no compact pool
        (dict(extra_body={"temprature": 0.5}), "temprature"),
        (dict(extra_body={"max_tokens": "ten"}), "max_tokens"),
    ]
    for kwargs, param in invalid:
        args = {"model": MODEL, "messages": CHAT, **kwargs}
        err = bad_status(lambda: chat(**args), openai.BadRequestError)  # noqa: B023
        assert (err.param, err.type) == (param, "invalid_request_error"), (kwargs, err.message)
        assert err.body["message"].startswith(param + ":"), err.body  # type: ignore[index]
    err = bad_status(lambda: chat(model="gpt-4", messages=CHAT), openai.NotFoundError)
    assert err.code == "model_not_found" and "tiny" in err.message
    anonymous = openai.OpenAI(base_url=cluster.base_url, api_key="wrong", max_retries=0)
    assert bad_status(lambda: anonymous.models.list(), openai.AuthenticationError).code == "invalid_api_key"
    assert httpx.post(cluster.base_url + "/completions", json={"prompt": "x"}).status_code == 401  # no key
    assert httpx.post(cluster.base_url + "/completions", content=b"{").status_code == 401  # before the body
    err = bad_status(lambda: chat(model=MODEL, messages=CHAT, n=MAX_WAITING + 1), openai.RateLimitError)
    assert "--max-waiting-requests" in err.message
    assert (
        bad_status(lambda: client.completions.create(model=MODEL, prompt=["a"] * 9, n=8), openai.BadRequestError).param
        == "prompt"
    )
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    malformed = httpx.post(cluster.base_url + "/completions", content=b'{"prompt": "x",', headers=auth)
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]["message"]
    huge = httpx.post(cluster.base_url + "/completions", content=b" " * (MAX_BODY_BYTES + 1), headers=auth)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    priority = httpx.post(cluster.base_url + "/completions", json={"prompt": "x"}, headers={**auth, "x-priority": "hi"})
    assert priority.status_code == 400 and priority.json()["error"]["param"] == "priority"
    still = client.completions.create(model=MODEL, prompt="still serving", max_tokens=2)
    assert still.usage is not None and still.usage.completion_tokens > 0


def test_clients_that_drop_mid_stream_free_every_block(cluster: Cluster) -> None:
    def aborted() -> float:
        scrape = httpx.get(root(cluster) + "/metrics").text
        line = next(
            (x for x in scrape.splitlines() if x.startswith("vllm:request_success_total") and '"abort"' in x), ""
        )
        return float(line.split()[-1]) if line else 0.0

    before = aborted()

    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Story number {i}"}], max_tokens=500,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        seen = 0
        async for chunk in stream:
            seen += bool(chunk.choices and chunk.choices[0].delta.content)
            if seen == 3:
                break
        await stream.close()  # drops the connection mid-stream
        return seen

    async def main() -> list[int]:
        client = async_client(cluster)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(20)))
        finally:
            await client.close()

    assert asyncio.run(main()) == [3] * 20
    final = wait_all_free(cluster)
    assert final.free_blocks == final.total_blocks
    wait_for(lambda: aborted() - before == 20, 10, "20 aborted requests")  # none ran its 500 tokens out


def test_503_until_the_workers_join(tiny_llama_dir: Path) -> None:
    http, grpc_port, worker_port = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "scheduler_node.cli.scheduler", "--model", str(tiny_llama_dir),
            "--port", str(grpc_port), "--worker-port", str(worker_port), "--openai-port", str(http)]  # fmt: skip
    scheduler = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{http}"

        def answers() -> bool:
            try:
                return httpx.get(url + "/health").status_code == 503
            except httpx.TransportError:
                return False

        wait_for(answers, 60, "the HTTP door answers")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        name = tiny_llama_dir.name
        err = bad_status(lambda: client.completions.create(model=name, prompt="x"), openai.InternalServerError)
        assert err.status_code == 503 and "joining" in err.message
        assert json.loads(httpx.get(url + "/health").text)["error"]["code"] == "service_unavailable"
    finally:
        scheduler.terminate()
        assert scheduler.wait(30) == 0
