"""Live migration at the OpenAI door (api/openai_migration.py) over stand-in workers whose output depends only on
the output position (ScriptedWorkers): a stream marked `migratable` that a drain moves ends with one `migrated`
event (no usage, no [DONE]); the same body with that event's data as `resume`, on another engine, continues it:
the same id, each choice from where it stopped, one usage for the whole request. What the router cannot continue
exactly runs on to its end, a draining replica takes back a stream it moved, and a bad `resume` is a 400 naming
its field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from router_node.http_migration import merged_answer
from scheduler_node.api.openai_migration import MIGRATED_EVENT, MIGRATED_HEADER
from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, build_app
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.metrics import Metrics
from tests.support.stand_in import ScriptedWorkers, running, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny"
SCRIPT = tokenizer().encode(" one two three four five six seven eight nine ten eleven twelve", False)
MAX_TOKENS = 10
MOVE_AT = 4  # outputs each sequence has when the drain moves it
CHAT = [{"role": "user", "content": "Count."}]
COMPLETION = {"model": MODEL, "prompt": "Count:", "max_tokens": MAX_TOKENS, "n": 2, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}, "migratable": True}  # fmt: skip

Scenario = Callable[[httpx.AsyncClient, httpx.AsyncClient, list[int]], Awaitable[None]]


def engine() -> EngineCore:
    return stand_in_engine(workers=ScriptedWorkers(SCRIPT, min(tokenizer().eos_token_ids)), max_num_seqs=16)


def serve(scenario: Scenario, sequences: int = 1) -> None:
    """`scenario` with a client of a source door, whose engine drains with migrate once it has run at least
    `sequences` sequences and each running one has MOVE_AT outputs (a request the scenario sends at once with others
    may reach the engine a few steps after them on a loaded machine), and of a target door; and what that drain
    moved (requests), once it ran."""

    async def main() -> None:
        source, target = engine(), engine()
        moved: list[int] = []

        seen: set[object] = set()  # the sequences the source has run

        def drain() -> None:
            live = source.scheduler.requests.values()
            seen.update(source.scheduler.requests)
            if live and len(seen) >= sequences and all(len(r.output_token_ids) >= MOVE_AT for r in live):
                source.after_step = None
                source.stop_admitting()  # as Control.Drain(migrate=true)
                moved.append(source.migrate())

        source.after_step = drain
        async with running(source), running(target), client(source) as moving, client(target) as taking:
            await scenario(moving, taking, moved)
        assert source.scheduler.blocks.num_used == 0, "the source freed every block"

    asyncio.run(main())


def client(engine: EngineCore) -> httpx.AsyncClient:
    door = OpenAIDoor(OpenAIConfig("127.0.0.1", 0, MODEL), tokenizer(), Metrics(MODEL))
    door.engine = engine
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(door)), base_url="http://door")


def events(response: httpx.Response) -> tuple[list[Any], dict[str, Any] | None]:
    """A stream's data events ("[DONE]" kept as is) and its `migrated` event's data (None: not there)."""
    data, migrated = [], None
    for event in response.text.split("\n\n"):
        if event.startswith(MIGRATED_EVENT):
            migrated = json.loads(event.split("data: ", 1)[1])
        elif event.startswith("data: "):
            body = event.removeprefix("data: ")
            data.append(body if body == "[DONE]" else json.loads(body))
    return data, migrated


def texts(chunks: list[Any], key: Callable[[dict[str, Any]], str | None]) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"] if isinstance(chunk, dict) else ():
            out[choice["index"]] = out.get(choice["index"], "") + (key(choice) or "")
    return out


def test_a_moved_completion_stream_goes_on_elsewhere_as_one_response() -> None:
    async def scenario(source: httpx.AsyncClient, target: httpx.AsyncClient, drained: list[int]) -> None:
        moved, migrated = events(await source.post("/v1/completions", json=COMPLETION))
        assert drained == [1] and migrated is not None and "[DONE]" not in moved, moved
        assert all(chunk["choices"] for chunk in moved), "no usage before the end of the whole request"
        assert not any(c["finish_reason"] for chunk in moved for c in chunk["choices"])
        rest, again = events(await target.post("/v1/completions", json={**COMPLETION, "resume": migrated}))
        assert again is None and rest[-1] == "[DONE]"
        chunks = [*moved, *rest[:-1]]
        assert {chunk["id"] for chunk in chunks} == {migrated["request_id"]}
        assert {chunk["created"] for chunk in chunks} == {migrated["created"]}
        want = tokenizer().decode(SCRIPT[:MAX_TOKENS])
        assert texts(chunks, lambda c: c["text"]) == {0: want, 1: want}, "no token lost or repeated"
        finishes = [(c["index"], c["finish_reason"]) for chunk in chunks for c in chunk["choices"]]
        assert sorted(f for f in finishes if f[1]) == [(0, "length"), (1, "length")]
        sent = texts(moved, lambda c: c["text"])
        assert migrated["text_offsets"] == [len(sent[0]), len(sent[1])], "logprobs' text_offset counts on from there"
        usage = chunks[-1]["usage"]
        assert not chunks[-1]["choices"] and usage["completion_tokens"] == 2 * MAX_TOKENS
        assert usage["prompt_tokens"] == len(tokenizer().encode("Count:")), usage

    serve(scenario)


def test_a_moved_chat_stream_sends_its_role_once() -> None:
    async def scenario(source: httpx.AsyncClient, target: httpx.AsyncClient, _: list[int]) -> None:
        body = {"messages": CHAT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "migratable": True}
        moved, migrated = events(await source.post("/v1/chat/completions", json=body))
        assert migrated is not None
        rest, __ = events(await target.post("/v1/chat/completions", json={**body, "resume": migrated}))
        chunks = [*moved, *rest[:-1]]
        roles = [c["delta"].get("role") for chunk in chunks for c in chunk["choices"]]
        assert roles.count("assistant") == 1 and roles[0] == "assistant"
        assert texts(chunks, lambda c: c["delta"].get("content")) == {0: tokenizer().decode(SCRIPT[:MAX_TOKENS])}

    serve(scenario)


def test_a_moved_unstreamed_answer_is_what_it_had_and_the_rest_comes_from_elsewhere() -> None:
    async def scenario(source: httpx.AsyncClient, target: httpx.AsyncClient, drained: list[int]) -> None:
        body = {**COMPLETION, "stream": False, "stream_options": None}
        moved = await source.post("/v1/completions", json=body)
        assert drained == [1] and moved.headers[MIGRATED_HEADER] == "true", moved.text
        partial, params = moved.json()["partial"], moved.json()["resume"]
        assert [c["finish_reason"] for c in partial["choices"]] == [None, None]
        rest = await target.post("/v1/completions", json={**body, "resume": params})
        assert MIGRATED_HEADER not in rest.headers
        whole = merged_answer([partial, rest.json()])
        want = tokenizer().decode(SCRIPT[:MAX_TOKENS])
        assert [(c["text"], c["finish_reason"]) for c in whole["choices"]] == [(want, "length")] * 2
        assert whole["id"] == partial["id"] and whole["usage"]["completion_tokens"] == 2 * MAX_TOKENS

    serve(scenario)


def test_what_cannot_move_exactly_runs_on_to_its_end() -> None:
    """Not marked, several prompts, a chat whose tool calls a parser reads: the drain lets them finish where they
    run."""

    async def scenario(source: httpx.AsyncClient, _: httpx.AsyncClient, drained: list[int]) -> None:
        unmarked = {**COMPLETION, "migratable": False}
        several = {**COMPLETION, "prompt": ["Count:", "Again:"]}
        tool = {"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}
        chat = {"messages": CHAT, "tools": [tool], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "migratable": True}  # fmt: skip
        answers = await asyncio.gather(
            source.post("/v1/completions", json=unmarked),
            source.post("/v1/completions", json=several),
            source.post("/v1/chat/completions", json=chat),
        )
        for answer in answers:
            chunks, migrated = events(answer)
            assert migrated is None and chunks[-1] == "[DONE]", chunks
        assert drained == [0], "the drain moved none of them"

    serve(scenario, sequences=7)  # n=2, two prompts of n=2, one chat: the drain comes with all of them running


def test_a_draining_replica_takes_back_a_stream_it_moved_and_nothing_else() -> None:
    async def scenario(source: httpx.AsyncClient, _: httpx.AsyncClient, drained: list[int]) -> None:
        moved, migrated = events(await source.post("/v1/completions", json=COMPLETION))
        assert migrated is not None and drained == [1]
        refused = await source.post("/v1/completions", json={**COMPLETION, "migratable": False})
        assert refused.status_code == 503
        stranger = {**migrated, "request_id": "cmpl-someone-else"}
        assert (await source.post("/v1/completions", json={**COMPLETION, "resume": stranger})).status_code == 503
        rest, __ = events(await source.post("/v1/completions", json={**COMPLETION, "resume": migrated}))
        want = tokenizer().decode(SCRIPT[:MAX_TOKENS])
        assert texts([*moved, *rest[:-1]], lambda c: c["text"]) == {0: want, 1: want}

    serve(scenario)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"states": "not base64!"}, "resume.states"),
        ({"states": "AAAA"}, "resume.states"),  # base64 of bytes that are no ResumeState
        ({"states": ""}, "resume.states"),
        ({"request_id": ""}, "resume.request_id"),
        ({"text_offsets": [0, 0, 0]}, "resume.text_offsets"),  # n = 2
        ({"completion_tokens": -1}, "resume.completion_tokens"),
    ],
)
def test_a_bad_resume_is_refused_naming_its_field(change: dict[str, Any], param: str) -> None:
    async def scenario(source: httpx.AsyncClient, target: httpx.AsyncClient, _: list[int]) -> None:
        __, migrated = events(await source.post("/v1/completions", json=COMPLETION))
        assert migrated is not None
        answer = await target.post("/v1/completions", json={**COMPLETION, "resume": {**migrated, **change}})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param, answer.text
        several = {**COMPLETION, "prompt": ["Count:", "Again:"], "resume": migrated}
        assert (await target.post("/v1/completions", json=several)).json()["error"]["param"] == "resume"

    serve(scenario)
