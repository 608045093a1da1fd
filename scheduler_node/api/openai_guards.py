"""What every HTTP request passes before it reaches a route: its credential (checked before the body is read) and
the body's size limit."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_node.api.openai_errors import OpenAIError

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # probes and Prometheus need no key
CONTROL_TAG = "control"  # the tag of the routes that change what the server serves (loading adapters: its files)


class BearerAuth:
    """401 unless `Authorization: Bearer <credential>` (compared in constant time). The credential a request needs:
    on a control route (tagged CONTROL_TAG) the control token when one is set, and the API key does not open it
    then (the key is for clients, the token for operators, as on gRPC where only the Control service takes the
    token); on OPEN_PATHS none; on any other path the API key when one is set.

    A control route is recognized with the router's own matching (`route.matches`), not by comparing path strings:
    Starlette's route patterns end in `$`, so `/v1/load_lora_adapter%0A` reaches that route while a string
    comparison would take it for another, open path."""

    def __init__(
        self, app: ASGIApp, api_key: str = "", control_token: str = "", control_routes: Sequence[BaseRoute] = ()
    ) -> None:
        self.app = app
        self.api_key = f"Bearer {api_key}".encode() if api_key else b""
        self.control_token = f"Bearer {control_token}".encode() if control_token else b""
        self.control_routes = control_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            logger.debug("refused %s %s: %s", scope["method"], scope["path"], refusal.message)
            await refusal.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> OpenAIError | None:
        """Why this request may not pass (None: it may)."""
        given = Headers(scope=scope).get("authorization", "").encode()
        if self.control_token and self._is_control(scope):
            if hmac.compare_digest(given, self.control_token):
                return None
            return OpenAIError(401, "a control route: send the header 'Authorization: Bearer <--control-token>'")
        if not self.api_key or scope["path"] in OPEN_PATHS or hmac.compare_digest(given, self.api_key):
            return None
        return OpenAIError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'")

    def _is_control(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] is not Match.NONE for route in self.control_routes)


def control_routes(app: FastAPI) -> list[BaseRoute]:
    """The app's routes tagged CONTROL_TAG."""
    return [r for r in app.routes if isinstance(r, APIRoute) and CONTROL_TAG in r.tags]


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
