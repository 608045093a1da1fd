"""A request message that does not parse is INVALID_ARGUMENT, not UNKNOWN.

gRPC parses a request before its handler runs, and a parser's exception ends the call with UNKNOWN ("Unexpected
DecodeError"), as a server fault would: a string field that is not UTF-8 (a lone surrogate, raw bytes) does
that. `DecodeGuard` has every handler of a single request receive the raw bytes and parse them itself.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        parse = None if handler is None else handler.request_deserializer
        if parse is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return handler._replace(request_deserializer=None, unary_stream=_streaming(handler.unary_stream, parse))  # type: ignore[attr-defined,no-any-return]
        return handler._replace(request_deserializer=None, unary_unary=_unary(handler.unary_unary, parse))  # type: ignore[attr-defined,no-any-return]


def _parsed(parse: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    """The request, or None with INVALID_ARGUMENT set on `context`."""
    try:
        return parse(raw)
    except DecodeError as exc:
        context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        context.set_details(f"the request does not parse: {exc} (every string field must be UTF-8)")
        return None


def _unary(behavior: Callable[..., Awaitable[Any]], parse: Callable[[bytes], Any]) -> Callable[..., Awaitable[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        request = _parsed(parse, raw, context)
        return None if request is None else await behavior(request, context)

    return handle


def _streaming(behavior: Callable[..., Any], parse: Callable[[bytes], Any]) -> Callable[..., AsyncIterator[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = _parsed(parse, raw, context)
        if request is None:
            return
        result = behavior(request, context)
        if inspect.isasyncgen(result):
            async for item in result:
                yield item
        else:  # a handler that writes with context.write
            await result

    return handle
