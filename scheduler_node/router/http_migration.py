"""Live migration at the router's HTTP door (router/http_door.py): a replica's server-sent events passed on whole
events at a time, never parsed, except the `migrated` event a drain ends a migratable stream with
(api/openai_migration.py), which is not the client's: its data is what the next replica continues the stream from
(router/migration.py); and the answers of an unstreamed request that moved, merged into one."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from proto import serving_pb2 as pb
from scheduler_node.api.openai_errors import OpenAIError
from scheduler_node.api.openai_migration import MIGRATED_EVENT

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
