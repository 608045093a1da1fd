"""The router's side of each replica: one gRPC channel per scheduler, and the forwarding of a Generate stream with
one retry.

A stream is passed on message by message as the replica sends it (no buffering). A stream that fails with
UNAVAILABLE before its first message (the replica died, is draining, or lost its workers) is sent once more to
another replica of that model; after the first message it ends with the replica's status, since sending it again
would repeat tokens the client already has. A LoRA adapter's request that a replica answers NOT_FOUND (unloaded
there since the last probe) goes to another replica that lists it, or ends NOT_FOUND. A replica drained with
migrate=true hands its running requests back (their sequences end "migrated", with their state): each is sent to
another replica with those states in `resume`, and the client's stream goes on as one request (live migration,
router/migration.py, shared with the HTTP door).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.wire import MAX_MESSAGE_BYTES
from router_node.kv_load import Ticket
from router_node.metrics import RouterMetrics
from router_node.migration import Journey
from router_node.prefix_sharing import PrefixSharing
from router_node.replica import NOT_SERVING, Replica, ReplicaPool
from router_node.request import RouteRequest
from router_node.routing import Route, RouteError, Router

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A replica that comes back is reconnected within about a probe interval (gRPC's default backoff grows to 2 min).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
FORWARDED_HEADERS = ("x-priority",)


@dataclass(slots=True)
class Link:
    channel: grpc.aio.Channel
    generation: pb_grpc.GenerationStub
    control: pb_grpc.ControlStub
    health: health_pb2_grpc.HealthStub


def open_link(address: str) -> Link:
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return Link(
        channel, pb_grpc.GenerationStub(channel), pb_grpc.ControlStub(channel), health_pb2_grpc.HealthStub(channel)
    )


def open_links(pool: ReplicaPool) -> dict[str, Link]:
    """One link per replica; whoever calls a replica looks its link up at each call (the prober may replace it)."""
    return {r.address: open_link(r.address) for r in pool.replicas}


RELEASE_TIMEOUT_S = 5.0  # an Abort that frees a lease; an unreleased lease expires on its own


class UpstreamError(Exception):
    """How a forwarded request ended when it did not end well: the status to give the client."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Forwarder:
    def __init__(self, router: Router, links: dict[str, Link], metrics: RouterMetrics) -> None:
        self.router = router
        self.links = links
        self.metrics = metrics
        # Asks the replicas again which LoRA adapters they serve (the prober's; None: never).
        self.refresh_adapters: Callable[[], Awaitable[None]] | None = None
        self._releases: set[asyncio.Task[None]] = set()  # Aborts that free leased KV on a replica
        # Live migration: each gRPC request open on a replica (since when), and those a rebalance moves now.
        self.streams: dict[str, tuple[Replica, float]] = {}
        self.rebalancing: set[str] = set()
        self.sharing: PrefixSharing | None = None  # --memory-sharing: prefixes pulled from peer replicas

    async def route(self, request: RouteRequest, failed: Sequence[Replica]) -> Route:
        """The router's decision; a name that no replica served at the last probe is looked up once more first
        (an adapter loaded on a replica since)."""
        try:
            return self.router.route(request, failed)
        except RouteError as exc:
            if exc.code != "NOT_FOUND" or self.refresh_adapters is None:
                raise
        await self.refresh_adapters()
        return self.router.route(request, failed)

    async def generate(
        self,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]] = (),
        exclude: Sequence[Replica] = (),
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The replica's responses to `request` as they come (never from a replica in `exclude`); UpstreamError
        with the status it ended with."""
        arrived = time.monotonic()
        request.migratable = True  # a draining replica hands it back (router/migration.py) instead of finishing it
        journey = Journey(self.router.pool, self.release, request.request_id)
        try:
            async for response in self._attempts(request, route_request, timeout, metadata, exclude, arrived, journey):
                journey.answered()
                yield response
        finally:
            journey.close()

    async def _attempts(
        self,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        exclude: Sequence[Replica],
        arrived: float,
        journey: Journey,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """`generate`'s attempts, replica after replica as they fail before a first message or hand it back."""
        deadline_s = request.deadline_s
        failed: list[Replica] = []
        while True:
            try:
                route = await self.route(route_request, [*exclude, *failed, *journey.moved_from])
            except RouteError as exc:
                back = journey.take_back()
                if back is None:
                    earlier = f" (it failed on {failed[0].address} before its first token)" if failed else ""
                    raise UpstreamError(grpc.StatusCode[exc.code], f"{exc}{earlier}") from None
                route = back
            replica = route.replica
            left = _time_left(request, timeout, deadline_s, arrived)
            request.model = route.model
            started = False
            states: list[pb.SequenceState] = []
            try:
                async for response in self._send(replica, request, route_request, left, metadata, route.ticket):
                    if response.HasField("migrated"):
                        states.append(response.migrated)  # not the client's: the stream goes on elsewhere
                        continue
                    started = True
                    yield response
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.UNAVAILABLE and self.unavailable(replica, details, started, failed):
                    logger.info("request %s: retrying on another replica: %s", request.request_id, details)
                    continue
                if code == grpc.StatusCode.NOT_FOUND and route.adapter and not started:
                    # The adapter was unloaded there since the last probe: another replica may still serve it.
                    replica.adapters -= {route.adapter}
                    failed.append(replica)
                    continue
                raise UpstreamError(code, f"replica {replica.address} ({replica.model}): {details}") from None
            if not states:
                return
            draining = request.request_id not in self.rebalancing
            self.rebalancing.discard(request.request_id)
            request.resume.CopyFrom(journey.handed_back(replica, states, draining))
            failed = []  # the target starts afresh: UNAVAILABLE before its first message is retried once more

    def _send(
        self,
        replica: Replica,
        request: pb.GenerateRequest,
        route_request: RouteRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        ticket: Ticket | None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The attempt on `replica`, its prompt's prefix first pulled from a peer that holds it (--memory-sharing)."""
        if self.sharing is None:
            return self._stream(replica, request, timeout, metadata, ticket)
        return self.sharing.stream(replica, request, route_request, timeout, metadata, ticket, self._stream)

    def release(self, replica: Replica, request_id: str) -> None:
        """Free the KV a replica keeps leased for a request (a migrated request's sequences, a disaggregated
        prefill's prompt) by an Abort of the request there: fire and forget, an unreleased lease expires on its
        own."""
        task = asyncio.ensure_future(self._abort(replica, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _abort(self, replica: Replica, request_id: str) -> None:
        abort = pb.AbortRequest(request_id=request_id)
        try:
            await self.links[replica.address].generation.Abort(abort, timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.info("the KV lease of %s on %s is left to expire: %s", request_id, replica.address, exc.details())

    def unavailable(self, replica: Replica, details: str, started: bool, failed: list[Replica]) -> bool:
        """A request failed on `replica` with UNAVAILABLE: it leaves the serving set until a probe says otherwise.
        True (and `replica` joins `failed`) when the request may go once more to another replica: nothing of it
        reached the client yet and it was not retried before."""
        self.router.pool.set_state(replica, NOT_SERVING, f"a request failed: {details}")
        if started or failed:
            return False
        failed.append(replica)
        self.metrics.retries.labels(replica.model).inc()
        return True

    def opened(self, replica: Replica) -> None:
        """A request goes to `replica` now (counted until closed(), so least_loaded sees it at once)."""
        self.metrics.requests.labels(replica.model, replica.address).inc()
        replica.requests += 1
        replica.in_flight += 1
        self.metrics.in_flight.labels(replica.model, replica.address).set(replica.in_flight)

    def closed(self, replica: Replica, ticket: Ticket | None = None) -> None:
        """The request's stream on `replica` closed (its `kv` ticket, if any, ends: its load there is gone)."""
        if ticket is not None:
            ticket.end()
        replica.in_flight -= 1
        self.metrics.in_flight.labels(replica.model, replica.address).set(replica.in_flight)

    async def _stream(
        self,
        replica: Replica,
        request: pb.GenerateRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        ticket: Ticket | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One attempt on one replica, measuring its time to first token and per output token (and telling the
        route's `kv` ticket when the prompt is computed and when the stream closed)."""
        self.opened(replica)
        call = self.links[replica.address].generation.Generate(request, timeout=timeout, metadata=metadata)
        sent = time.monotonic()
        self.streams[request.request_id] = (replica, sent)
        first = last = 0.0
        tokens = 0  # of sequence 0: with n > 1 the sequences advance together
        try:
            async for response in call:
                last = time.monotonic()
                if not first:
                    first = last
                    replica.observe_ttft(first - sent)
                    if ticket is not None:
                        ticket.prefilled()
                if response.index == 0:
                    tokens += len(response.token_ids)
                yield response
        finally:
            call.cancel()  # the client went away: the replica aborts the request (no-op once the call ended)
            self.streams.pop(request.request_id, None)
            self.closed(replica, ticket)
            if tokens > 1:
                replica.observe_tpot((last - first) / (tokens - 1))


def forwarded_metadata(metadata: Sequence[tuple[str, str | bytes]]) -> list[tuple[str, str]]:
    """The client's headers the replica reads (the priority header)."""
    return [(k, v) for k, v in metadata if k in FORWARDED_HEADERS and isinstance(v, str)]


def _time_left(request: pb.GenerateRequest, timeout: float | None, deadline_s: float, arrived: float) -> float | None:
    """What is left of the client's gRPC deadline (returned) and of the request's `deadline_s` (set in `request`):
    both count from the arrival at the router, so a retry gets only the rest."""
    elapsed = time.monotonic() - arrived
    if deadline_s > 0:
        if deadline_s <= elapsed:
            raise UpstreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline_s {deadline_s:g} passed before a retry")
        request.deadline_s = deadline_s - elapsed
    if timeout is None:
        return None
    if timeout <= elapsed:
        raise UpstreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before a retry")
    return timeout - elapsed
