"""`--memory-sharing` (the scheduler article's `scheduling_policy.memory_sharing: enabled`): a replica chosen for a
request whose prompt prefix a peer replica holds pulls those KV blocks from the peer instead of recomputing them.

It is disaggregation's handoff (router_node/disaggregate.py) with the peer as the producer: once the strategy has
chosen replica B, the router looks in its KV index (the replicas' KV events, router_node/kv_index.py) for the
serving replica A of the model that holds the most leading blocks of the prompt. When A holds at least
`min_gain` blocks more than B, the router sends A the prompt's first `blocks x block_size + 1` token ids under the
id `<id>.share` with `kv_handoff.produce` and one output token: A finds those blocks in its prefix cache, computes
the one token after them, and holds the blocks under a lease (scheduler_node/core/kv/leases.py), answered in its
last response's `kv_source`. B then gets the request with that source: it imports the blocks its own cache lacks
(worker_node/kv/transfer/) and computes only the rest; its usage's cached tokens count them. A's lease is
released (an Abort of `<id>.share`) once B's first response arrives, or when B's stream ends any other way. A share
that fails, or that A cannot offer, costs only its time: B computes the prompt itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from proto import serving_pb2 as pb
from router_node.kv_load import Ticket
from router_node.kv_strategy import KVAware
from router_node.replica import Replica, ReplicaPool
from router_node.request import RouteRequest

logger = logging.getLogger(__name__)

SHARE_SUFFIX = ".share"
# What a replica sends a request to and streams back: the forwarder's one attempt on one replica.
Send = Callable[
    [Replica, pb.GenerateRequest, float | None, Sequence[tuple[str, str]], Ticket | None],
    AsyncIterator[pb.GenerateResponse],
]


@dataclass(frozen=True, slots=True)
class Share:
    """Where a prompt's leading blocks wait for the chosen replica: the peer, its share request, its lease."""

    peer: Replica
    request_id: str  # on the peer: an Abort of it frees the lease
    source: pb.KVHandoff
    tokens: int  # the prompt tokens those blocks hold


class PrefixSharing:
    def __init__(
        self, pool: ReplicaPool, kv: KVAware, release: Callable[[Replica, str], None], min_gain: int = 1
    ) -> None:
        self.pool = pool
        self.kv = kv  # its index, feeds and tokenizers: who holds which prefix
        self.release = release  # the forwarder's: an Abort that frees a lease
        self.min_gain = min_gain
        self.shares = 0  # requests whose prefix came from a peer
        self.shared_tokens = 0  # prompt tokens those peers' blocks held
        self.failed = 0  # shares the peer could not serve: the chosen replica computed the prompt

    def peer(self, chosen: Replica, request: RouteRequest) -> tuple[Replica, int, int] | None:
        """The serving peer of `chosen` holding the most leading blocks of the prompt beyond `chosen`'s own, with
        how many it holds and its block size; None when none holds `min_gain` more."""
        peers = [r for r in self.pool.serving(chosen.model) if r is not chosen]
        if not peers:
            return None
        found = self.kv.cached(request, [chosen, *peers])
        if found is None or not found[2]:  # no tokens, or no replica's index is synchronized
            return None
        counts = found[0]
        best = max(peers, key=lambda r: counts[r.address])
        feed = self.kv.feeds.get(best.address)
        if feed is None or counts[best.address] < counts[chosen.address] + self.min_gain:
            return None
        return best, counts[best.address], feed.block_size

    async def stream(
        self,
        chosen: Replica,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        ticket: Ticket | None,
        send: Send,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """`send`'s stream of `request` on `chosen`, its prompt's prefix pulled from a peer that holds it."""
        share = None
        if not request.HasField("kv_handoff") and not request.HasField("resume"):
            share = await self._share(chosen, request, route_request, timeout, metadata, send)
        borrowed = share is not None
        if share is not None:
            request.kv_handoff.CopyFrom(share.source)
        try:
            async for response in send(chosen, request, timeout, metadata, ticket):
                if share is not None:  # it pulled the blocks before computing its first token
                    self.release(share.peer, share.request_id)
                    share = None
                yield response
        finally:
            if share is not None:
                self.release(share.peer, share.request_id)
            if borrowed:
                request.ClearField("kv_handoff")  # a retry elsewhere looks again

    async def _share(
        self,
        chosen: Replica,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        send: Send,
    ) -> Share | None:
        """The peer's lease on the prompt's leading blocks it holds; None when no peer holds more than `chosen`."""
        found = self.peer(chosen, route_request)
        ids = self.kv.prompts.ids(route_request, chosen.model)
        if found is None or ids is None:
            return None
        peer, blocks, block_size = found
        share = self._share_request(request, ids[: min(blocks * block_size + 1, len(ids))])
        source: pb.KVHandoff | None = None
        try:
            async for response in send(peer, share, timeout, metadata, None):
                if response.HasField("kv_source") and response.kv_source.lease and response.kv_source.blocks:
                    source = response.kv_source
        except grpc.aio.AioRpcError as exc:
            logger.info("request %s: %s could not share its prefix: %s", request.request_id, peer.address, exc)
        if source is None:
            self.failed += 1
            return None
        self.shares += 1
        self.shared_tokens += len(source.blocks) * block_size
        logger.debug("request %s: %d prefix blocks from %s", request.request_id, len(source.blocks), peer.address)
        return Share(peer, share.request_id, source, len(source.blocks) * block_size)

    @staticmethod
    def _share_request(request: pb.GenerateRequest, token_ids: list[int]) -> pb.GenerateRequest:
        """The peer's request: the prefix as token ids (its salt and model kept: they key the blocks), one greedy
        token, its KV held under a lease."""
        share = pb.GenerateRequest(
            request_id=request.request_id + SHARE_SUFFIX,
            prompt_token_ids=pb.TokenIds(ids=token_ids),
            cache_salt=request.cache_salt,
            model=request.model,
            kv_precision=request.kv_precision,
        )
        share.sampling.max_tokens = 1
        share.sampling.temperature = 0.0
        share.kv_handoff.produce = True
        return share
