"""--disaggregate's short-prompt path without processes: the gRPC door sends a prompt too short to move
(--disaggregate-min-prompt-tokens) straight to a decode replica and a long one through the prefill hop; the router
counts token ids exactly and text as characters / 4. (The OpenAI door's side: tests/router_node/
test_http_door.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from proto import serving_pb2 as pb
from router_node.disaggregate import Disaggregator
from router_node.grpc_door import RouterGeneration, from_grpc
from router_node.metrics import RouterMetrics
from router_node.replica import SERVING, Replica, ReplicaPool, ReplicaSpec
from router_node.request import RouteRequest
from router_node.routing import Router
from router_node.upstream import Forwarder

pytestmark = pytest.mark.unit


def _generation(min_prompt_tokens: int) -> tuple[RouterGeneration, list[tuple[str, list[str]]]]:
    """A --disaggregate router's gRPC door over a prefill and a decode replica whose streams are stand-ins: each
    call recorded as (which path, the replicas it excluded)."""
    pool = ReplicaPool([ReplicaSpec("h:1", "m", kv_role="prefill"), ReplicaSpec("h:2", "m", kv_role="decode")])
    for replica in pool.replicas:
        pool.set_state(replica, SERVING)
    forwarder = Forwarder(Router(pool, "round_robin"), {}, RouterMetrics())
    generation = RouterGeneration(forwarder, 1.0)
    disaggregator = generation.disaggregator = Disaggregator(forwarder, min_prompt_tokens)
    calls: list[tuple[str, list[str]]] = []

    async def direct(*args: object, exclude: Sequence[Replica] = ()) -> AsyncIterator[pb.GenerateResponse]:
        calls.append(("direct", [r.spec.kv_role for r in exclude]))
        yield pb.GenerateResponse()

    async def handoff(*args: object) -> AsyncIterator[pb.GenerateResponse]:
        calls.append(("prefill hop", []))
        yield pb.GenerateResponse()

    forwarder.generate = direct  # type: ignore[method-assign, assignment]
    disaggregator.generate = handoff  # type: ignore[method-assign, assignment]
    return generation, calls


async def _drain(generation: RouterGeneration, request: pb.GenerateRequest) -> None:
    async for _ in generation._generate(request, from_grpc(request, {}), None, ()):
        pass


def test_a_short_prompt_goes_straight_to_decode_and_a_long_one_through_prefill() -> None:
    generation, calls = _generation(min_prompt_tokens=64)
    short = pb.GenerateRequest(model="m", prompt_token_ids=pb.TokenIds(ids=list(range(63))))
    long = pb.GenerateRequest(model="m", prompt_token_ids=pb.TokenIds(ids=list(range(64))))
    asyncio.run(_drain(generation, short))
    asyncio.run(_drain(generation, long))
    assert calls == [("direct", ["prefill"]), ("prefill hop", [])], "short: never on the prefill-only replica"
    assert generation.disaggregator is not None and generation.disaggregator.direct == 1


def test_every_prompt_is_moved_at_a_bar_of_zero() -> None:
    generation, calls = _generation(min_prompt_tokens=0)
    asyncio.run(_drain(generation, pb.GenerateRequest(model="m", prompt="")))
    assert calls == [("prefill hop", [])]


def test_prompt_tokens_are_counted_from_ids_or_as_characters_over_four() -> None:
    assert RouteRequest("m", prompt_token_ids=[1, 2, 3]).estimated_prompt_tokens() == 3
    assert RouteRequest("m", prompt="x" * 259).estimated_prompt_tokens() == 64
    chat = RouteRequest("m", messages=[("system", "x" * 100), ("user", "y" * 28)])
    assert chat.estimated_prompt_tokens() == 32


def test_a_negative_bar_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from router_node.main import main

    with pytest.raises(SystemExit) as exited:
        main(["--disaggregate", "--disaggregate-min-prompt-tokens", "-1", "--replica", "h:1,model=m"])
    assert exited.value.code == 2
    assert "--disaggregate-min-prompt-tokens must be >= 0, got -1" in capsys.readouterr().err
