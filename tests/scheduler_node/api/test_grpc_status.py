"""refuse(): a refused call's status is set on its context (never raised), and UNAVAILABLE says when to retry."""

from __future__ import annotations

import grpc
import pytest

from scheduler_node.api.grpc_status import RETRY_AFTER, refuse

pytestmark = pytest.mark.unit


class Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailers: tuple = ()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailers: tuple) -> None:
        self.trailers = trailers


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE])
def test_refuse_sets_the_status_and_a_retry_hint_only_when_unavailable(code: grpc.StatusCode) -> None:
    context = Context()
    refuse(context, code, "request_id: longer than 256 characters")  # type: ignore[arg-type]
    assert (context.code, context.details) == (code, "request_id: longer than 256 characters")
    assert context.trailers == (RETRY_AFTER if code == grpc.StatusCode.UNAVAILABLE else ())
    assert dict(RETRY_AFTER)["retry-after"].isdigit()
