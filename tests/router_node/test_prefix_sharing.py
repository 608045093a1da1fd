"""--memory-sharing without processes: a request routed (round robin) to a replica that lacks its prompt's prefix
first asks the peer that holds it (per the KV index) for a lease on those blocks, with the prefix alone as token
ids, and goes to the chosen replica with that source; the lease is released after the chosen replica's first
response. Nothing held elsewhere, a peer that offers nothing, or a request that already carries a handoff: sent as
it is. (End to end with processes: tests/e2e/test_memory_sharing.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from proto import serving_pb2 as pb
from router_node.kv_load import Ticket
from router_node.main import memory_sharing
from router_node.metrics import RouterMetrics
from router_node.prefix_sharing import SHARE_SUFFIX, PrefixSharing
from router_node.replica import Replica
from router_node.request import RouteRequest
from router_node.routing import Router
from router_node.upstream import Forwarder
from tests.router_node.test_kv_routing import BS, hold, kv_pool

pytestmark = pytest.mark.unit

PROMPT = list(range(100, 122))  # 5 full blocks of 4 and 2 tokens


class Replicas:
    """Stand-in streams: what each replica was sent, in order; a share request answers with a lease."""

    def __init__(self, offer: bool = True) -> None:
        self.sent: list[tuple[str, pb.GenerateRequest]] = []
        self.released: list[tuple[str, str]] = []
        self.offer = offer

    async def stream(
        self,
        replica: Replica,
        request: pb.GenerateRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        ticket: Ticket | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        copy = pb.GenerateRequest()
        copy.CopyFrom(request)
        self.sent.append((replica.address, copy))
        if request.kv_handoff.produce:
            blocks = list(range(len(request.prompt_token_ids.ids) // BS))
            offered = pb.KVHandoff(addresses=["x:1"], lease=b"L" * 16, blocks=blocks) if self.offer else None
            yield pb.GenerateResponse(token_ids=[1], kv_source=offered)
            return
        yield pb.GenerateResponse(token_ids=[7])
        if request.HasField("kv_handoff"):
            assert self.released == [(self.sent[0][0], request.request_id + SHARE_SUFFIX)], "released on the first"
        yield pb.GenerateResponse(token_ids=[8])

    def release(self, replica: Replica, request_id: str) -> None:
        self.released.append((replica.address, request_id))


def _setup(offer: bool = True) -> tuple[Forwarder, Replicas, PrefixSharing, list[Replica]]:
    pool, _, feeds, kv = kv_pool()
    replicas = Replicas(offer)
    forwarder = Forwarder(Router(pool, "round_robin"), {}, RouterMetrics())
    forwarder.sharing = sharing = memory_sharing(pool, kv, replicas.release)
    forwarder._stream = replicas.stream  # type: ignore[method-assign]
    a, b = pool.replicas
    hold(feeds[a.address], PROMPT[:16])  # a holds 4 leading blocks, b none
    return forwarder, replicas, sharing, [a, b]


async def _run(forwarder: Forwarder, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    route = RouteRequest("m", prompt_token_ids=list(request.prompt_token_ids.ids))
    return [r async for r in forwarder.generate(request, route, None)]


def test_the_chosen_replica_pulls_the_prefix_its_peer_holds() -> None:
    forwarder, replicas, sharing, (a, b) = _setup()
    first = pb.GenerateRequest(request_id="r1", model="m", prompt_token_ids=pb.TokenIds(ids=PROMPT), cache_salt="")
    asyncio.run(_run(forwarder, first))  # round robin: a, which holds it itself
    assert [(address, r.request_id) for address, r in replicas.sent] == [("h:1", "r1")]
    replicas.sent.clear()
    second = pb.GenerateRequest(request_id="r2", model="m", prompt_token_ids=pb.TokenIds(ids=PROMPT))
    responses = asyncio.run(_run(forwarder, second))  # round robin: b, which holds nothing
    (peer, share), (chosen, sent) = replicas.sent
    assert (peer, share.request_id, chosen, sent.request_id) == ("h:1", "r2.share", "h:2", "r2")
    assert list(share.prompt_token_ids.ids) == PROMPT[:17], "the 4 blocks a holds and the token after them"
    assert share.kv_handoff.produce and share.sampling.max_tokens == 1
    assert list(sent.prompt_token_ids.ids) == PROMPT and list(sent.kv_handoff.blocks) == [0, 1, 2, 3]
    assert sent.kv_handoff.lease == b"L" * 16 and [r.token_ids[0] for r in responses] == [7, 8]
    assert replicas.released == [("h:1", "r2.share")]
    assert (sharing.shares, sharing.shared_tokens, sharing.failed) == (1, 16, 0)
    assert not second.HasField("kv_handoff"), "a retry elsewhere looks again"


def test_nothing_to_pull_or_nothing_offered_sends_the_request_as_it_is() -> None:
    forwarder, replicas, sharing, (a, b) = _setup(offer=False)
    other = pb.GenerateRequest(request_id="o", model="m", prompt_token_ids=pb.TokenIds(ids=list(range(500, 520))))
    asyncio.run(
        _run(forwarder, pb.GenerateRequest(request_id="r1", model="m", prompt_token_ids=other.prompt_token_ids))
    )
    asyncio.run(_run(forwarder, other))  # b: nobody holds this prompt
    assert [(address, r.request_id) for address, r in replicas.sent] == [("h:1", "r1"), ("h:2", "o")]
    replicas.sent.clear()
    asyncio.run(
        _run(forwarder, pb.GenerateRequest(request_id="r", model="m", prompt_token_ids=pb.TokenIds(ids=PROMPT)))
    )
    asyncio.run(
        _run(forwarder, pb.GenerateRequest(request_id="s", model="m", prompt_token_ids=pb.TokenIds(ids=PROMPT)))
    )
    assert [r.request_id for _, r in replicas.sent] == ["r", "s.share", "s"]  # a offered no lease: b computes it
    assert not replicas.sent[-1][1].HasField("kv_handoff") and sharing.failed == 1


def test_memory_sharing_needs_two_replicas_of_a_model() -> None:
    pool, _, _, kv = kv_pool(1)
    with pytest.raises(ValueError, match=r"--memory-sharing .* give 2\+ --replica of a model"):
        memory_sharing(pool, kv, lambda replica, request_id: None)
