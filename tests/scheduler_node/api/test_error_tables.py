"""The engine tells a door how a request ended in door-neutral types (FinishReason, EngineError with an
ErrorStatus); each door maps them to its protocol in one table, which must cover every status."""

from __future__ import annotations

import grpc
import pytest

from scheduler_node.api.grpc_server import GRPC_STATUS
from scheduler_node.api.openai_errors import HTTP_STATUS, KINDS, engine_error
from scheduler_node.core.request import FinishReason, Status
from scheduler_node.engine.outputs import EngineError, ErrorStatus

pytestmark = pytest.mark.unit


def test_every_door_maps_every_status() -> None:
    assert set(GRPC_STATUS) == set(ErrorStatus) == set(HTTP_STATUS)
    assert all(isinstance(code, grpc.StatusCode) for code in GRPC_STATUS.values())
    assert set(HTTP_STATUS.values()) <= set(KINDS), "each HTTP status has its OpenAI error type and code"


@pytest.mark.parametrize(
    ("status", "grpc_code", "http"),
    [
        (ErrorStatus.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
        (ErrorStatus.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (ErrorStatus.INTERNAL, grpc.StatusCode.INTERNAL, 500),
        (ErrorStatus.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION, 422),
    ],
)
def test_what_a_client_sees(status: ErrorStatus, grpc_code: grpc.StatusCode, http: int) -> None:
    """docs/design.md, "What a client sees"; the offline LLM names the status as gRPC does."""
    assert GRPC_STATUS[status] == grpc_code and grpc_code.name == status.name
    error = engine_error(EngineError(status, "why"))
    assert error.status == http
    kind, code = KINDS[http]
    assert error.body()["error"] == {"message": "why", "type": kind, "param": None, "code": code}
    assert kind == ("invalid_request_error" if http < 500 else "server_error")


def test_every_end_of_a_request_has_a_finish_reason() -> None:
    finished = [s for s in Status if s.finished]
    assert sorted(s.finish_reason for s in finished) == sorted(FinishReason)
    # The strings clients read ("migrated": vllm-router's, never passed on to its clients).
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error", "migrated"]
    with pytest.raises(ValueError):
        Status.RUNNING.finish_reason  # noqa: B018
