"""What every HTTP request passes before it reaches a route: the API key (checked before the body is read) and
the body's size limit."""

from __future__ import annotations

import hmac
import logging

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_node.api.openai_errors import OpenAIError

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # probes and Prometheus need no key


class ApiKeyAuth:
    """401 unless `Authorization: Bearer <key>` (compared in constant time); OPEN_PATHS excepted."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                logger.debug("refused %s %s: missing or wrong API key", scope["method"], scope["path"])
                error = OpenAIError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'")
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a request body over `max_bytes`: at once when Content-Length says so, else (chunked) as soon as
    the bytes read pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        total = 0

        async def limited() -> Message:
            nonlocal total
            message = await receive()
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                raise HTTPException(413, self._too_large().message)  # FastAPI lets it through to _http_error
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than {self.max_bytes} bytes")
