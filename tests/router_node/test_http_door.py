"""The router's OpenAI door over stand-in replica doors (small aiohttp apps in this process): a LoRA adapter that a
replica listed but answers 404 for (unloaded there since the last probe) is tried on another replica that lists it,
and is the client's 404 only when none is left; with --disaggregate a completion is prefilled on the prefill door
(one token, `kv_transfer_params.produce`) and decoded on the other with the lease it got, or without one when the
prefill failed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from aiohttp import web

from router_node.grpc_door import RouterGeneration
from router_node.http_door import RouterHttp, build_router_app
from router_node.metrics import RouterMetrics
from router_node.replica import SERVING, Replica, ReplicaPool, ReplicaSpec
from router_node.routing import Router
from router_node.upstream import Forwarder
from tests.support.http_doors import serve_apps

pytestmark = pytest.mark.unit

MODEL = "base"


def _replica_door(served: set[str]) -> web.Application:
    """A replica's /v1/completions: 404 (as a scheduler's door words it) for a model it does not serve."""

    async def completions(request: web.Request) -> web.Response:
        name = (await request.json())["model"]
        if name not in served:
            error = {"message": f"model: {name!r} is not served here", "code": "model_not_found", "param": "model"}
            return web.json_response({"error": error}, status=404)
        return web.json_response({"object": "text_completion", "model": name, "served_by": request.url.port})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@asynccontextmanager
async def _doors(*served: set[str]) -> AsyncIterator[list[int]]:
    """One stand-in replica door per set of served names; their ports."""
    async with serve_apps([_replica_door(names) for names in served]) as ports:
        yield ports


async def _scenario(served: list[set[str]], model: str) -> tuple[list[int], httpx.Response, ReplicaPool]:
    """Replica doors serving `served`, each listed by the router as serving "sql"; the router's answer to a
    completion for `model`."""
    async with _doors(*served) as ports:
        answer, pool = await _post(ports, "sql", model)
    return ports, answer, pool


async def _post(ports: Sequence[int], listed: str, model: str) -> tuple[httpx.Response, ReplicaPool]:
    """POST a completion for `model` through a router whose replicas (at `ports`) all listed `listed`."""
    pool = ReplicaPool(ReplicaSpec(f"127.0.0.1:{i + 1}", MODEL, http=f"127.0.0.1:{p}") for i, p in enumerate(ports))
    for replica in pool.replicas:
        pool.set_state(replica, SERVING)
        replica.adapters = frozenset({listed})
    forwarder = Forwarder(Router(pool, "round_robin"), {}, RouterMetrics())  # round robin: the first replica first
    door = RouterHttp(RouterGeneration(forwarder, 1.0), "", 5.0)
    transport = httpx.ASGITransport(app=build_router_app(door, ""))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            body: dict[str, Any] = {"model": model, "prompt": "hi", "max_tokens": 2}
            return await client.post("/v1/completions", json=body), pool
    finally:
        await door.close()


def test_an_adapter_unloaded_on_one_replica_is_served_by_another_that_lists_it() -> None:
    ports, answer, pool = asyncio.run(_scenario([set(), {"sql"}], "sql"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["served_by"] == ports[1]
    first, second = pool.replicas
    assert first.requests == 1, "the first replica was asked first (and answered 404)"
    assert first.adapters == frozenset(), "a router forgets an adapter its replica answers 404 for"
    assert second.adapters == frozenset({"sql"})
    assert first.in_flight == second.in_flight == 0


def test_an_adapter_no_replica_serves_any_more_is_the_clients_404() -> None:
    _, answer, pool = asyncio.run(_scenario([set(), set()], "sql"))
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "model_not_found"
    assert all(r.requests == 1 and r.adapters == frozenset() and r.in_flight == 0 for r in pool.replicas)


def test_a_base_model_404_is_passed_on_without_a_retry() -> None:
    _, answer, pool = asyncio.run(_scenario([set(), {MODEL}], MODEL))  # not an adapter: no retry
    assert answer.status_code == 404, answer.text
    assert [r.requests for r in pool.replicas] == [1, 0]


def _handoff_door(bodies: list[dict[str, Any]], prefill_status: int) -> web.Application:
    """A replica's /v1/completions that records each body: a produce request is answered with `prefill_status` and,
    when 200, a lease; any other with the `kv_transfer_params` it got."""

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        if body.get("kv_transfer_params", {}).get("produce"):
            if prefill_status != 200:
                return web.json_response({"error": {"message": "no"}}, status=prefill_status)
            params = {"addresses": ["127.0.0.1:9"], "lease": "00" * 16, "blocks": [3, 4], "request_id": "cmpl-p-0"}
            return web.json_response({"object": "text_completion", "kv_transfer_params": params})
        return web.json_response({"object": "text_completion", "got": body.get("kv_transfer_params")})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


Bodies = list[dict[str, Any]]


async def _disaggregated(
    prefill_status: int, prompt: str = "hi", min_prompt_tokens: int = 0
) -> tuple[httpx.Response, Bodies, Bodies, list[tuple[str, str]]]:
    """A completion of `prompt` through a --disaggregate router (--disaggregate-min-prompt-tokens
    `min_prompt_tokens`) over a prefill and a decode stand-in door: the answer, each door's bodies, and the leases
    released (replica, request id)."""
    from router_node.disaggregate import Disaggregator

    bodies: tuple[Bodies, Bodies] = ([], [])
    released: list[tuple[str, str]] = []
    async with serve_apps([_handoff_door(b, prefill_status) for b in bodies]) as ports:
        roles = ("prefill", "decode")
        pool = ReplicaPool(
            ReplicaSpec(f"127.0.0.1:{i + 1}", MODEL, http=f"127.0.0.1:{p}", kv_role=role)
            for i, (p, role) in enumerate(zip(ports, roles))
        )
        for replica in pool.replicas:
            pool.set_state(replica, SERVING)
        forwarder = Forwarder(Router(pool, "round_robin"), {}, RouterMetrics())
        generation = RouterGeneration(forwarder, 1.0)
        disaggregator = generation.disaggregator = Disaggregator(forwarder, min_prompt_tokens)

        def release(replica: Replica, prefill_id: str) -> None:  # what a gRPC Abort would free
            released.append((replica.spec.kv_role, prefill_id))

        disaggregator.release = release  # type: ignore[method-assign]
        door = RouterHttp(generation, "", 5.0)
        transport = httpx.ASGITransport(app=build_router_app(door, ""))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "n": 1, "stream": False}
                answer = await client.post("/v1/completions", json=body)
        finally:
            await door.close()
    return answer, *bodies, released


def test_disaggregate_prefills_on_one_door_and_decodes_on_the_other_with_its_lease() -> None:
    answer, prefilled, decoded, released = asyncio.run(_disaggregated(200))
    assert answer.status_code == 200, answer.text
    [prefill] = prefilled
    assert (prefill["max_tokens"], prefill["stream"], prefill["kv_transfer_params"]) == (1, False, {"produce": True})
    lease = {"addresses": ["127.0.0.1:9"], "lease": "00" * 16, "blocks": [3, 4]}
    assert [d["max_tokens"] for d in decoded] == [5] and answer.json()["got"] == lease
    assert released == [("prefill", "cmpl-p-0")], "the lease is released once the decode replica answered"


def test_a_failed_prefill_leaves_the_decode_door_to_compute_the_prompt() -> None:
    answer, prefilled, decoded, released = asyncio.run(_disaggregated(503))
    assert answer.status_code == 200, answer.text
    assert len(prefilled) == 1 and len(decoded) == 1 and answer.json()["got"] is None
    assert released == [], "no lease to release"


def test_a_prompt_too_short_to_move_goes_straight_to_the_decode_door() -> None:
    # 16 tokens as the router counts text (characters / 4) under a bar of 64: no prefill hop, no lease
    answer, prefilled, decoded, released = asyncio.run(_disaggregated(200, "word" * 16, min_prompt_tokens=64))
    assert answer.status_code == 200, answer.text
    assert prefilled == [] and len(decoded) == 1 and answer.json()["got"] is None
    assert released == []
    # 64 tokens: at the bar, moved
    answer, prefilled, decoded, released = asyncio.run(_disaggregated(200, "word" * 64, min_prompt_tokens=64))
    assert len(prefilled) == 1 and answer.json()["got"] is not None and len(released) == 1
