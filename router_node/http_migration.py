"""Live migration at the router's HTTP door (router/http_door.py): a replica's server-sent events passed on whole
events at a time, never parsed, except the `migrated` event a drain ends a migratable stream with
(api/openai_migration.py), which is not the client's: its data is what the next replica continues the stream from
(router/migration.py); and the answers of an unstreamed request that moved, merged into one."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from fastapi import Response
from fastapi.responses import JSONResponse
from google.protobuf.message import DecodeError

from proto import serving_pb2 as pb
from router_node.migration import Journey
from router_node.replica import Replica
from router_node.routing import Route
from router_node.upstream import Forwarder
from scheduler_node.api.openai_errors import OpenAIError
from scheduler_node.api.openai_migration import MIGRATED_EVENT, MIGRATED_HEADER

UPSTREAM_ERRORS = (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError)
Attempt = tuple[Replica, aiohttp.ClientResponse, bytes]  # the replica, its answer, its first chunk (or whole body)
Resend = Callable[[Sequence[Replica], Route | None], Awaitable[Attempt]]  # the request again: (exclude, route)

MIGRATED = MIGRATED_EVENT.encode()
END = b"\n\n"  # ends an event: its lines never hold an empty one (JSON escapes its newlines)
MAX_HANDBACK_BYTES = 64 << 20  # a migrated event's size bound (its states: tokens and KV block ids)


class Content(Protocol):
    """aiohttp's StreamReader, as read here."""

    async def readany(self) -> bytes: ...


class Upstream(Protocol):
    @property
    def content(self) -> Content: ...


@dataclass(frozen=True, slots=True)
class Handback:
    """A stream a drain moved: its id on the replicas, its states, and the event's data as sent back (`resume`)."""

    request_id: str
    states: pb.ResumeState
    params: dict[str, Any]


async def events(answer: Upstream, first: bytes) -> AsyncIterator[bytes | Handback]:
    """The stream's bytes, whole events at a time as they arrive (`first` is its first chunk); its last event, when
    it is `migrated`, as a Handback (ValueError when that event is not well formed)."""
    pending = first
    while True:
        cut = pending.rfind(END) + len(END)
        if cut >= len(END):
            whole, pending = pending[:cut], pending[cut:]
            at = _migrated_at(whole)
            if at < 0:
                yield whole
            else:
                if at:
                    yield whole[:at]
                event = whole[at:] + pending
                while chunk := await answer.content.readany():  # the stream ends with it
                    event += chunk
                    if len(event) > MAX_HANDBACK_BYTES:
                        raise ValueError(f"a migrated event of more than {MAX_HANDBACK_BYTES} bytes")
                yield handback(event)
                return
        chunk = await answer.content.readany()
        if not chunk:
            if pending:
                yield pending
            return
        pending += chunk


def _migrated_at(data: bytes) -> int:
    """Where the `migrated` event begins in whole events (-1: not there)."""
    if data.startswith(MIGRATED):
        return 0
    at = data.find(END + MIGRATED)
    return at + len(END) if at >= 0 else -1


def handback(event: bytes) -> Handback:
    """A `migrated` event read; ValueError naming what is wrong."""
    try:
        params = json.loads(event[len(MIGRATED) :].strip())
    except ValueError as exc:
        raise ValueError(f"a migrated event that is not well formed: {exc}") from None
    return read_handback(params)


def read_handback(params: Any) -> Handback:
    """A moved request's `resume` params (a migrated event's data, or an unstreamed answer's) read; ValueError
    naming what is wrong."""
    try:
        states = pb.ResumeState.FromString(base64.b64decode(params["states"], validate=True))
        request_id = params["request_id"]
    except (ValueError, KeyError, TypeError, binascii.Error, DecodeError) as exc:
        raise ValueError(f"a migrated event that is not well formed: {exc!r}") from None
    if not isinstance(request_id, str) or not states.sequences:
        raise ValueError("a migrated event without a request id or sequences")
    return Handback(request_id, states, params)


def merged_answer(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One unstreamed answer of a moved request's parts, replica after replica (the last one whole): each choice's
    text (a chat's content) and logprobs joined, its one finish_reason, the last part's id, usage and the rest."""
    whole = parts[-1]
    for choice in whole.get("choices", []):
        pieces = [c for part in parts for c in part.get("choices", []) if c.get("index") == choice.get("index")]
        logprobs = [p["logprobs"] for p in pieces if p.get("logprobs")]
        if "message" in choice:  # a chat's: its output is all content (api/openai_migration.py)
            choice["message"]["content"] = "".join(p["message"].get("content") or "" for p in pieces)
        else:
            choice["text"] = "".join(p.get("text") or "" for p in pieces)
        if logprobs:  # a chat's {"content": [...]}, a completion's lists by key: each joined
            choice["logprobs"] = {key: [x for lp in logprobs for x in lp[key]] for key in logprobs[0]}
        choice["finish_reason"] = next((p["finish_reason"] for p in pieces if p.get("finish_reason")), None)
    return whole


def error_event(status: int, message: str) -> bytes:
    """The event that ends a stream whose status line is long gone."""
    return f"data: {json.dumps(OpenAIError(status, message).body())}\n\n".encode()


class MovedRequests:
    """The router's HTTP door's side of live migration: a request a drain hands back goes on from the next replica
    (the same Journey as a gRPC request's, router/migration.py), its stream spliced into one, or its unstreamed
    answers merged into one."""

    def __init__(self, forwarder: Forwarder, count_error: Callable[[str, str], None]) -> None:
        self.forwarder = forwarder
        self.pool = forwarder.router.pool
        self.count_error = count_error

    async def relay(
        self,
        replica: Replica,
        answer: aiohttp.ClientResponse,
        first: bytes,
        stack: contextlib.ExitStack,
        payload: dict[str, Any],
        resend: Resend,
    ) -> AsyncIterator[bytes]:
        """The stream as the replica sends it; when a drain hands it back (its `migrated` event), the rest of it
        from the replica that continues it (`resend`: the request with `resume`), so the client sees one stream."""
        journey: Journey | None = None
        try:
            while True:
                handback = None
                async for piece in self._pass(replica, answer, first):
                    if isinstance(piece, Handback):
                        handback = piece
                    else:
                        if journey is not None:
                            journey.answered()
                        yield piece
                if handback is None:
                    return
                if journey is None:
                    journey = Journey(self.pool, self.forwarder.release, handback.request_id)
                payload["resume"] = handback.params
                journey.handed_back(replica, handback.states.sequences)
                moved = await self._next(journey, resend)
                if isinstance(moved, OpenAIError):
                    yield error_event(moved.status, moved.message)
                    return
                replica, answer, first = moved
        finally:
            if journey is not None:
                journey.close()
            stack.close()

    async def _pass(
        self, replica: Replica, answer: aiohttp.ClientResponse, first: bytes
    ) -> AsyncIterator[bytes | Handback]:
        """One replica's stream, whole events at a time; its `migrated` event (the last) as a Handback. A replica
        that breaks off ends the stream with an error event naming it."""
        ended = False
        try:
            async for piece in events(answer, first):
                yield piece
            ended = True
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            details = f"replica {replica.spec.http} ({replica.model}) failed mid-stream: {describe(exc)}"
            self.forwarder.unavailable(replica, details, True, [])
            self.count_error(replica.model, "UNAVAILABLE")
            yield error_event(503, details)
        finally:
            if ended:
                answer.release()  # the connection goes back to the pool
            else:
                answer.close()  # the client went away (or the replica did): closing makes the replica abort

    async def collected(
        self, replica: Replica, answer: aiohttp.ClientResponse, data: bytes, payload: dict[str, Any], resend: Resend
    ) -> Response:
        """An unstreamed answer a drain moved: the request goes on where a stream would, and the answers of the
        replicas it went through are merged into one."""
        parts: list[dict[str, Any]] = []
        journey: Journey | None = None
        try:
            while answer.headers.get(MIGRATED_HEADER):
                answer.release()
                try:
                    moved = json.loads(data)
                    handback = read_handback(moved["resume"])
                    parts.append(moved["partial"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise OpenAIError(503, f"replica {replica.spec.http} ({replica.model}): {exc}") from None
                journey = journey or Journey(self.pool, self.forwarder.release, handback.request_id)
                payload["resume"] = handback.params
                journey.handed_back(replica, handback.states.sequences)
                attempt = await self._next(journey, resend)
                if isinstance(attempt, OpenAIError):
                    raise attempt
                replica, answer, data = attempt
                journey.answered()
            answer.release()
            return JSONResponse(merged_answer([*parts, json.loads(data)]))
        finally:
            if journey is not None:
                journey.close()

    async def _next(self, journey: Journey, resend: Resend) -> Attempt | OpenAIError:
        """The replica that continues a handed-back request, its response and first chunk (or whole body); or the
        error that ends the request when none does (the last replica that handed it back takes it back first)."""
        attempt = await _attempt_or_error(resend(journey.moved_from, None))
        refused = isinstance(attempt, OpenAIError) or attempt[1].status == 503
        if refused and (back := journey.take_back()) is not None:
            if not isinstance(attempt, OpenAIError):
                attempt[1].release()
            attempt = await _attempt_or_error(resend((), back))
        if isinstance(attempt, OpenAIError):
            return attempt
        replica, answer, first = attempt
        if answer.status != 200:
            answer.release()
            return OpenAIError(answer.status, error_message(first))
        return attempt


async def _attempt_or_error(attempt: Awaitable[Attempt]) -> Attempt | OpenAIError:
    try:
        return await attempt
    except OpenAIError as exc:
        return exc


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def error_message(body: bytes) -> str:
    """The message of an OpenAI error body (or the body itself when it is not one)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]
