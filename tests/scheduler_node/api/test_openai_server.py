"""The OpenAI door in this process: its FastAPI app, called through httpx's ASGI transport (no socket), drives an
EngineCore over stand-in workers. Shapes of answers and streams, usage, the API key, every error's status and
`param`, the queue bound, tokenize/detokenize, /health and /metrics, without a child process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from scheduler_node.api.openai_server import MAX_BODY_BYTES, OpenAIConfig, OpenAIDoor, build_app
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.outputs import RequestStream
from settings.priority import PriorityConfig
from tests.support.stand_in import TOKEN, ControlledWorkers, running, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny"
KEY = "sk-unit"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Tell me about the sea."}]

Scenario = Callable[[httpx.AsyncClient, OpenAIDoor], Awaitable[None]]


def serve(engine: EngineCore | None, scenario: Scenario, api_key: str = KEY) -> None:
    """Run `scenario` with a client of the door over `engine` (None: the workers have not joined)."""

    async def main() -> None:
        door = OpenAIDoor(OpenAIConfig("127.0.0.1", 0, MODEL, api_key), tokenizer(), Metrics(MODEL))
        door.engine = engine
        transport = httpx.ASGITransport(app=build_app(door))
        async with httpx.AsyncClient(transport=transport, base_url="http://door", headers=AUTH) as client:
            if engine is None:
                await scenario(client, door)
                return
            async with running(engine):
                await scenario(client, door)

    asyncio.run(main())


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def events(response: httpx.Response) -> list[Any]:
    """A server-sent-event stream's data, parsed ("[DONE]" kept as is)."""
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_a_completion_and_a_chat_answer_with_the_engines_tokens_and_usage() -> None:
    async def scenario(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        body = {"model": MODEL, "prompt": [list(range(100, 120))], "max_tokens": 4, "temperature": 0}
        body["ignore_eos"] = True
        answer = (await client.post("/v1/completions", json=body)).json()
        assert answer["object"] == "text_completion" and answer["model"] == MODEL
        (choice,) = answer["choices"]
        assert choice["text"] == door.tokenizer.decode([TOKEN] * 4) and choice["finish_reason"] == "length"
        usage = {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24}
        assert answer["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
        again = (await client.post("/v1/completions", json=body)).json()  # its one full block is cached now
        assert again["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 16}}
        chat = {"messages": CHAT, "max_tokens": 3, "n": 2, "ignore_eos": True}
        chat_answer = (await client.post("/v1/chat/completions", json=chat)).json()
        assert [c["index"] for c in chat_answer["choices"]] == [0, 1]
        assert {c["message"]["role"] for c in chat_answer["choices"]} == {"assistant"}
        prompt = len(door.tokenizer.apply_chat_template(CHAT))  # type: ignore[arg-type]
        assert chat_answer["usage"]["prompt_tokens"] == prompt and chat_answer["usage"]["completion_tokens"] == 6

    serve(stand_in_engine(), scenario)


def test_a_stream_sends_the_role_then_the_text_then_the_usage_then_done() -> None:
    async def scenario(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        body = {"messages": CHAT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True}  # fmt: skip
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        chunks = events(response)
        assert chunks[-1] == "[DONE]"
        chunks = chunks[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == door.tokenizer.decode([TOKEN] * 5)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert not chunks[-1]["choices"] and chunks[-1]["usage"]["completion_tokens"] == 5
        prompt = len(door.tokenizer.apply_chat_template(CHAT))
        cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        again = events(await client.post("/v1/chat/completions", json=body))[-2]["usage"]
        assert (cached, again["prompt_tokens_details"]["cached_tokens"]) == (0, prompt // 16 * 16)

    serve(stand_in_engine(), scenario)


def test_the_api_key_guards_every_path_but_the_probes() -> None:
    async def scenario(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
            refused = await client.get("/v1/models", headers=headers)
            assert refused.status_code == 401 and error_of(refused)["code"] == "invalid_api_key"
        assert (await client.get("/health", headers={"Authorization": ""})).status_code == 200
        assert (await client.get("/metrics", headers={"Authorization": ""})).status_code == 200
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL]

    serve(stand_in_engine(), scenario)


def test_errors_name_their_field_with_the_status_openai_uses() -> None:
    engine = stand_in_engine(EngineOptions(max_waiting_requests=4))

    async def scenario(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        for change, param in ((dict(temperature=-1), "temperature"), (dict(max_tokens=0), "max_tokens"),
                              (dict(messages=[]), "messages"), (dict(temprature=0.5), "temprature")):  # fmt: skip
            bad = await client.post("/v1/chat/completions", json={"messages": CHAT, **change})
            error = error_of(bad)
            assert (bad.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error"), error
            assert error["message"].startswith(param + ":"), error
        for body, param in (({"prompt": "x", "n": 65}, "n"), ({"prompt": ["x"] * 33, "n": 2}, "prompt")):
            bad = await client.post("/v1/completions", json=body)
            assert (bad.status_code, error_of(bad)["param"]) == (400, param), error_of(bad)
        other = await client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": CHAT})
        assert other.status_code == 404 and error_of(other)["code"] == "model_not_found"
        full = await client.post("/v1/chat/completions", json={"messages": CHAT, "n": 5})
        assert full.status_code == 429 and "--max-waiting-requests 4" in error_of(full)["message"]
        json_type = {**AUTH, "Content-Type": "application/json"}
        malformed = await client.post("/v1/completions", content=b'{"prompt": "x",', headers=json_type)
        assert malformed.status_code == 400 and "not valid JSON" in error_of(malformed)["message"]
        huge = await client.post("/v1/completions", content=b" " * (MAX_BODY_BYTES + 1))
        assert huge.status_code == 413 and error_of(huge)["code"] == "request_too_large"
        priority = await client.post("/v1/completions", json={"prompt": "x"}, headers={**AUTH, "x-priority": "hi"})
        assert priority.status_code == 400 and error_of(priority)["param"] == "priority"

    serve(engine, scenario)


def test_tokenize_and_detokenize_round_trip() -> None:
    async def scenario(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        text = "Hello there, world"
        got = (await client.post("/tokenize", json={"prompt": text})).json()
        assert got["tokens"] == door.tokenizer.encode(text) and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == 64 * 16
        back = (await client.post("/detokenize", json={"tokens": got["tokens"]})).json()
        assert back == {"prompt": text}

    serve(stand_in_engine(), scenario)


def test_without_ready_workers_the_door_says_503_and_why() -> None:
    async def scenario(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        for path in ("/health", "/v1/completions"):
            answer = await (client.get(path) if path == "/health" else client.post(path, json={"prompt": "x"}))
            assert answer.status_code == 503 and "joining" in error_of(answer)["message"]
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL]

    serve(None, scenario)
    workers = ControlledWorkers()
    workers.lose()

    async def lost(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        answer = await client.get("/health")
        assert answer.status_code == 503 and error_of(answer)["message"] == "a worker is not ready"

    serve(stand_in_engine(workers=workers, options=EngineOptions(rejoin_timeout=60)), lost)


def test_a_named_priority_in_the_body_or_the_x_priority_header_is_its_ranges_middle() -> None:
    ranges = PriorityConfig(default_priority=45, priority_ranges="realtime=80-100,batch=20-40")
    engine = stand_in_engine(EngineOptions(priorities=ranges))
    submitted: list[int] = []
    submit = engine.submit

    def recording(spec: RequestSpec, deadline_s: float = 0.0) -> RequestStream:
        submitted.append(spec.priority)
        return submit(spec, deadline_s)

    engine.submit = recording  # type: ignore[method-assign]

    async def scenario(client: httpx.AsyncClient, door: OpenAIDoor) -> None:
        body = {"prompt": "x", "max_tokens": 1}
        for headers, priority in (({"X-Priority": "realtime"}, None), ({}, "batch"), ({"X-Priority": "90"}, None),
                                  ({}, None), ({"X-Priority": "realtime"}, 7)):  # fmt: skip
            sent = body if priority is None else {**body, "priority": priority}
            answer = await client.post("/v1/completions", json=sent, headers=headers)
            assert answer.status_code == 200, answer.text
        unknown = await client.post("/v1/completions", json=body, headers={"X-Priority": "urgent"})
        assert unknown.status_code == 400 and error_of(unknown)["param"] == "priority"
        assert "realtime=80-100" in error_of(unknown)["message"]

    serve(engine, scenario)
    assert submitted == [90, 30, 90, 45, 7]  # the body's own priority wins over the header
