"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the matching status."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from scheduler_node.engine.outputs import EngineError, ErrorStatus

# status -> OpenAI's error type and code
KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "unprocessable_request"),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}

# Seconds a refused client is asked to wait before trying again (here, or on another replica): the HTTP doors'
# `Retry-After` on every 503 and the gRPC door's `retry-after` trailer on UNAVAILABLE. Workers joining, a drain or
# shutdown, a world being rebuilt: each passes, or the address gets another server, within seconds.
RETRY_AFTER_S = 5

# How the engine's failures reach an HTTP client: one status each (its OpenAI error type and code from KINDS).
HTTP_STATUS: dict[ErrorStatus, int] = {
    ErrorStatus.UNAVAILABLE: 503,
    ErrorStatus.DEADLINE_EXCEEDED: 504,
    ErrorStatus.INTERNAL: 500,
    ErrorStatus.FAILED_PRECONDITION: 422,
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | int | None]]:
        kind, code = KINDS.get(self.status, ("server_error" if self.status >= 500 else "invalid_request_error", None))
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code or code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        if self.status == 503:  # unavailable for now, not for good
            headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def engine_error(error: EngineError) -> OpenAIError:
    """A request the engine ended with an error."""
    return OpenAIError(HTTP_STATUS[error.status], error.message)


def param_of(loc: tuple[str | int, ...]) -> str:
    """A pydantic error location in the body as OpenAI names params: messages[0].content."""
    name = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker for a mapping's key: the key itself is already named
            continue
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid_body)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the first wrong field (the body's JSON, types and unknown fields; ranges come later)."""
    first = exc.errors()[0]
    loc = tuple(first["loc"])
    if loc[:1] == ("body",):
        loc = loc[1:]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return OpenAIError(400, f"the body is not valid JSON: {detail} at character {loc[0]}").response()
    if first["type"] == "lone_surrogate":  # found anywhere in the body: the error names where
        loc = (first["ctx"]["param"],)
    if not loc:
        return OpenAIError(400, "the body must be a JSON object (Content-Type: application/json)").response()
    param = param_of(loc)
    return OpenAIError(400, f"{param}: {first['msg']}", param).response()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown routes, wrong methods, bodies over the size limit."""
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    return OpenAIError(exc.status_code, message).response(exc.headers)
