"""An answer's JSON, encoded off the event loop when it is large.

json.dumps is C that holds the GIL from start to end: in a thread it would still stop the event loop for as long
as it takes (seconds for an answer of many logprobs). So a large body is encoded in a thread piece by piece,
long lists a slice at a time: between two pieces the interpreter hands the GIL to the event loop, which keeps
every other stream flowing while the answer is built.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from typing import Any

from starlette.responses import Response

PIECE = 256  # list items per json.dumps call: a few milliseconds of GIL at most
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # as JSONResponse's


def encode(body: Any) -> bytes:
    """`body` as JSONResponse would render it, in pieces (between which other threads run)."""
    return "".join(_pieces(body)).encode()


def sse_event(body: dict[str, Any]) -> str:
    """One server-sent event of `body`, in pieces (Shape.sse's text of it)."""
    return f"data: {''.join(_pieces(body))}\n\n"


def _pieces(value: Any) -> Iterator[str]:
    if _small(value, 2):
        yield _ENCODER.encode(value)
    elif isinstance(value, Mapping):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _ENCODER.encode(key) + ":"
            yield from _pieces(item)
        yield "}"
    else:  # a long list, or one holding large values
        yield "["
        batch: list[Any] = []
        first = True
        for item in [*value, _END]:
            if item is not _END and _small(item, 2) and len(batch) < PIECE:
                batch.append(item)
                continue
            if batch:
                yield ("" if first else ",") + _ENCODER.encode(batch)[1:-1]
                batch, first = [], False
            if item is _END:
                break
            if _small(item, 2):
                batch.append(item)
            else:
                yield "" if first else ","
                yield from _pieces(item)
                first = False
        yield "]"


def _small(value: Any, depth: int) -> bool:
    """Is `value` encoded in one go cheaply: a scalar, or a short container of such (`depth` levels down)?"""
    if isinstance(value, (Mapping, list)):
        items = value.values() if isinstance(value, Mapping) else value
        return depth > 0 and len(value) <= 32 and all(_small(item, depth - 1) for item in items)
    return True


_END = object()


async def json_response(body: dict[str, Any], large: bool) -> Response:
    """The answer as application/json; a `large` one is encoded in a thread, piece by piece."""
    content = await asyncio.to_thread(encode, body) if large else _ENCODER.encode(body).encode()
    return Response(content, media_type="application/json")
