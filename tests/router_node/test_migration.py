"""Live migration through the router's OpenAI door (router/migration.py's Journey, router/http_migration.py) over
stand-in replica doors (small aiohttp apps in this process) that hand a request back: a stream with a `migrated`
event, an unstreamed answer with its state. The client sees one stream (one answer), the next replica gets the
state as `resume`, the replica that handed it back leaves the serving set and its KV lease is released once the
next one answered; with no other replica the one that handed it back takes it back, once."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import httpx
import pytest
from aiohttp import web

from proto import serving_pb2 as pb
from router_node.grpc_door import RouterGeneration
from router_node.http_door import RouterHttp, build_router_app
from router_node.metrics import RouterMetrics
from router_node.migration import Journey
from router_node.replica import NOT_SERVING, SERVING, Replica, ReplicaPool, ReplicaSpec
from router_node.routing import Router
from router_node.upstream import Forwarder
from scheduler_node.api.openai_migration import MIGRATED_HEADER
from tests.support.http_doors import serve_apps

pytestmark = pytest.mark.unit

MODEL = "base"
LEASED = pb.SequenceState(index=0, output_token_ids=[5, 6], kv_source=pb.KVHandoff(addresses=["h:9"], lease=b"l"))
PARAMS = {"request_id": "cmpl-1", "created": 7, "text_offsets": [2], "completion_tokens": 0,
          "states": base64.b64encode(pb.ResumeState(sequences=[LEASED]).SerializeToString()).decode()}  # fmt: skip


def chunk(text: str) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def _door(bodies: list[dict[str, Any]], hands_back: int) -> web.Application:
    """A replica's /v1/completions: the first `hands_back` requests it gets are handed back after two chunks (the
    migrated event written in two pieces), any other continues with two chunks and [DONE]; unstreamed, the
    answers of that."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if not body.get("stream"):
            text, end = (" a b", None) if len(bodies) <= hands_back else (" c d", "length")
            whole: dict[str, Any] = {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": end}]}
            whole["usage"] = len(bodies)
            if len(bodies) <= hands_back:
                return web.json_response({"resume": PARAMS, "partial": whole}, headers={MIGRATED_HEADER: "true"})
            return web.json_response(whole)
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        if len(bodies) <= hands_back:
            event = f"event: migrated\ndata: {json.dumps(PARAMS)}\n\n".encode()
            for piece in (chunk(" a") + chunk(" b") + event[:20], event[20:]):
                await answer.write(piece)
        else:
            await answer.write(chunk(" c") + chunk(" d") + b"data: [DONE]\n\n")
        await answer.write_eof()
        return answer

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _through_router(
    hands_back: list[int], stream: bool = True
) -> tuple[str, list[list[dict[str, Any]]], ReplicaPool, list[str]]:
    """A completion through the router over one stand-in door per entry (each handing back that many requests):
    what the client got, each door's bodies, the pool, and the leases released (replica addresses)."""
    bodies: list[list[dict[str, Any]]] = [[] for _ in hands_back]
    released: list[str] = []
    async with serve_apps([_door(b, n) for b, n in zip(bodies, hands_back)]) as ports:
        pool = ReplicaPool(ReplicaSpec(f"127.0.0.1:{i + 1}", MODEL, http=f"127.0.0.1:{p}") for i, p in enumerate(ports))
        for replica in pool.replicas:
            pool.set_state(replica, SERVING)
        forwarder = Forwarder(Router(pool, "round_robin"), {}, RouterMetrics())

        def release(replica: Replica, request_id: str) -> None:  # what a gRPC Abort would free
            released.append(f"{replica.address} {request_id}")

        forwarder.release = release  # type: ignore[method-assign]
        door = RouterHttp(RouterGeneration(forwarder, 1.0), "", 5.0)
        transport = httpx.ASGITransport(app=build_router_app(door, ""))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream}
                answer = await client.post("/v1/completions", json=body)
        finally:
            await door.close()
    return answer.text, bodies, pool, released


def test_a_handed_back_stream_goes_on_from_another_replica_as_one_stream() -> None:
    text, (first, second), pool, released = asyncio.run(_through_router([1, 0]))
    assert text.encode() == chunk(" a") + chunk(" b") + chunk(" c") + chunk(" d") + b"data: [DONE]\n\n"
    [asked], [resumed] = first, second
    assert asked["migratable"] is True and "resume" not in asked
    assert resumed["resume"] == PARAMS and resumed["migratable"] is True
    assert pool.replicas[0].state == NOT_SERVING and pool.replicas[1].state == SERVING
    assert released == ["127.0.0.1:1 cmpl-1"], "its KV lease is released once the target answered"
    assert all(r.in_flight == 0 for r in pool.replicas)


def test_a_moved_unstreamed_answer_is_merged_from_the_replicas_it_went_through() -> None:
    text, (first, second), _, released = asyncio.run(_through_router([1, 0], stream=False))
    answer = json.loads(text)
    assert answer["choices"] == [{"index": 0, "text": " a b c d", "finish_reason": "length"}]
    assert answer["usage"] == 1, "the last replica's usage (it counted the whole request)"
    assert [b.get("resume") for b in (*first, *second)] == [None, PARAMS] and released == ["127.0.0.1:1 cmpl-1"]

    text, _, _, _ = asyncio.run(_through_router([2], stream=False))  # handed back again: nowhere left to go
    assert "serving" in json.loads(text)["error"]["message"]


def test_with_no_other_replica_the_one_that_handed_it_back_takes_it_back_once() -> None:
    text, [bodies], _, released = asyncio.run(_through_router([1]))
    assert text.encode() == chunk(" a") + chunk(" b") + chunk(" c") + chunk(" d") + b"data: [DONE]\n\n"
    assert [b.get("resume") for b in bodies] == [None, PARAMS]
    assert released == [], "a replica that takes a request back frees its KV itself"

    text, [bodies], _, _ = asyncio.run(_through_router([2]))  # handed back again: nowhere left to go
    assert len(bodies) == 2 and text.count(" a") == 2
    error = json.loads(text.rsplit("data: ", 1)[1])["error"]
    assert error["type"] == "server_error" and "serving" in error["message"], error


def test_a_replica_that_drained_and_came_back_serving_is_a_target_again() -> None:
    """A rolling restart drains replica 0 (its requests move to 1), restarts it at its address, then drains 1: the
    requests that left 0 may go back to the new scheduler there, not to 1 again."""
    pool = ReplicaPool([ReplicaSpec("h:1", MODEL), ReplicaSpec("h:2", MODEL)])
    first, second = pool.replicas
    for replica in pool.replicas:
        pool.set_state(replica, SERVING)
    journey = Journey(pool, lambda replica, request_id: None, "r")
    journey.handed_back(first, [pb.SequenceState(index=0)])
    assert journey.moved_from == [first], "the draining scheduler is never chosen again"
    pool.set_state(first, SERVING)  # restarted and probed: another scheduler at the same address
    journey.handed_back(second, [pb.SequenceState(index=0)])
    assert journey.moved_from == [second]
    route = journey.take_back()
    assert route is not None and route.replica is second, "taken back by the one that handed it back last"


def test_a_journey_holds_leased_kv_until_the_target_answers() -> None:
    pool = ReplicaPool([ReplicaSpec("h:1", MODEL), ReplicaSpec("h:2", MODEL)])
    released: list[str] = []
    journey = Journey(pool, lambda replica, request_id: released.append(f"{replica.address} {request_id}"), "r")
    source, target = pool.replicas
    resume = journey.handed_back(source, [LEASED, pb.SequenceState(index=1)][::-1])
    assert [s.index for s in resume.sequences] == [0, 1] and source.state == NOT_SERVING
    assert journey.moved_from == [source] and released == []
    journey.answered()
    journey.answered()
    assert released == ["h:1 r"], "released once"
    journey.handed_back(target, [pb.SequenceState(index=0)])  # no KV named: nothing held
    journey.close()
    assert released == ["h:1 r"]
    route = journey.take_back()
    assert route is not None and route.replica is target and journey.take_back() is None
