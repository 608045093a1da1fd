"""`vllm-router --disaggregate`: each request's prompt is computed on a prefill replica and its output generated on
a decode replica, which pulls the prompt's KV from the prefill replica's workers (worker_node/kv/transfer/exporter.py).

A replica's role is its `kv_role=` (prefill, decode or both; its vllm-serve --kv-role). The router sends a copy of
the request to a prefill replica under the id `<id>.prefill`, with one output token and `kv_handoff.produce`; its
last response names where the prompt's KV waits (`kv_source`). The request then goes to a decode replica with that
source, and streams from there. The prefill's lease is released (an Abort of `<id>.prefill`) once the decode
replica's first response arrives (it pulled the blocks before computing its first token), or when the stream ends
any other way: a client that goes away leaves no blocks leased. A prompt shorter than `min_prompt_tokens`
(--disaggregate-min-prompt-tokens) skips the prefill hop and goes straight to a decode replica: its few blocks are
cheaper to compute there than to queue behind long prompts on the prefill replica and then move. A prefill that
fails, or has no source to offer, costs only time: the decode replica computes the prompt itself. A producer that
dies mid-transfer makes the decode replica's pull fail within its timeout, and it recomputes. The OpenAI door does
the same over the replicas' HTTP doors with `kv_transfer_params` (router/http_door.py), releasing the lease through
the replica's gRPC Abort.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from proto import serving_pb2 as pb
from router_node.replica import Replica
from router_node.request import RouteRequest
from router_node.routing import RouteError
from router_node.upstream import Forwarder
from settings.router import DEFAULT_MIN_PROMPT_TOKENS

logger = logging.getLogger(__name__)

PREFILL_SUFFIX = ".prefill"
# Shorter prompts (4 blocks of 16) are computed where they decode: a chat turn's prompt costs a decode replica about
# one step, while the prefill hop queues it behind every long prompt the prefill replica holds, then adds a transfer.


class Disaggregator:
    def __init__(self, forwarder: Forwarder, min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS) -> None:
        self.forwarder = forwarder
        self.min_prompt_tokens = min_prompt_tokens
        self.pool = forwarder.router.pool
        self.handoffs = 0  # requests decoded from a prefill's KV
        self.fallbacks = 0  # requests whose prefill failed or offered nothing: the decode replica computed them
        self.direct = 0  # requests whose prompt was too short to move: sent straight to a decode replica

    def worth_moving(self, request: RouteRequest) -> bool:
        """Whether the request's prompt goes through a prefill replica (both doors ask); counts the ones that do not."""
        if request.estimated_prompt_tokens() >= self.min_prompt_tokens:
            return True
        self.direct += 1
        return False

    def _only(self, role: str) -> list[Replica]:
        return [r for r in self.pool.replicas if r.spec.kv_role == role]

    async def generate(
        self,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[pb.GenerateResponse]:
        produced = await self._prefill(request, route_request, timeout, metadata)
        decode = pb.GenerateRequest()
        decode.CopyFrom(request)
        if produced is not None:
            decode.kv_handoff.CopyFrom(produced[2])
            self.handoffs += 1
        else:
            self.fallbacks += 1
        released = produced is None
        try:
            stream = self.forwarder.generate(decode, route_request, timeout, metadata, exclude=self._only("prefill"))
            async for response in stream:
                if not released:
                    released = True
                    self._release(produced)
                yield response
        finally:
            if not released:
                self._release(produced)

    async def _prefill(
        self,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
    ) -> tuple[Replica, pb.GenerateRequest, pb.KVHandoff] | None:
        """The prompt computed on a prefill replica: that replica and where its KV waits; None when it failed."""
        prefill = pb.GenerateRequest()
        prefill.CopyFrom(request)
        prefill.request_id = request.request_id + PREFILL_SUFFIX
        prefill.sampling.max_tokens = 1
        prefill.sampling.n = 1
        prefill.kv_handoff.produce = True
        source: pb.KVHandoff | None = None
        try:
            route = self.forwarder.router.route(route_request, self._only("decode"))
            replica = route.replica
            prefill.model = replica.model
            async for response in self.forwarder._stream(replica, prefill, timeout, metadata, route.ticket):
                if response.HasField("kv_source") and response.kv_source.lease:
                    source = response.kv_source
        except (grpc.aio.AioRpcError, RouteError) as exc:
            logger.info(
                "request %s: prefill failed, the decode replica computes the prompt: %s", request.request_id, exc
            )
            return None
        return (replica, prefill, source) if source is not None else None

    def _release(self, produced: tuple[Replica, pb.GenerateRequest, pb.KVHandoff] | None) -> None:
        if produced is not None:
            self.release(produced[0], produced[1].request_id)

    def release(self, replica: Replica, prefill_id: str) -> None:
        """Free a prefill's lease on `replica` (fire and forget: an unreleased lease expires on its own)."""
        self.forwarder.release(replica, prefill_id)

    def prefill_only(self) -> list[Replica]:
        """The replicas a decode (or any whole request) never goes to."""
        return self._only("prefill")

    def decode_only(self) -> list[Replica]:
        """The replicas a prefill never goes to."""
        return self._only("decode")
