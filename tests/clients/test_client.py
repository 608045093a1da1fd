"""vllm-client's defaults a newcomer can live with: the chat template when the model has one (raw text when the
server says it has none, or with --no-chat), and a bounded answer length."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from clients.client import build_parser, stream
from proto import serving_pb2 as pb
from scheduler_node.api.validation import NO_CHAT_TEMPLATE
from settings.tools import DEFAULT_MAX_TOKENS

pytestmark = pytest.mark.unit


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeStub:
    """Answers each Generate with one delta, or refuses `messages` like a server whose model has no template."""

    def __init__(self, has_template: bool = True, refusal: str = f"messages: {NO_CHAT_TEMPLATE}") -> None:
        self.has_template, self.refusal = has_template, refusal
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request: pb.GenerateRequest, timeout: float) -> Iterator[pb.GenerateResponse]:  # noqa: N802
        self.requests.append(request)
        if request.HasField("messages") and not self.has_template:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, self.refusal)
        yield pb.GenerateResponse(text="Paris.", finish_reason="stop")


def run(argv: list[str], stub: FakeStub) -> int:
    args = build_parser().parse_args(argv)
    return stream(stub, args, args.prompt)  # type: ignore[arg-type]


def test_the_default_is_a_chat_message_and_a_bounded_length() -> None:
    stub = FakeStub()
    assert run(["What is the capital of France?"], stub) == 0
    (request,) = stub.requests
    assert request.WhichOneof("input") == "messages"
    assert request.messages.messages[0].content == "What is the capital of France?"
    assert request.sampling.max_tokens == DEFAULT_MAX_TOKENS == 256


def test_a_model_without_a_chat_template_gets_the_raw_text() -> None:
    stub = FakeStub(has_template=False)
    assert run(["The capital of France is"], stub) == 0
    assert [r.WhichOneof("input") for r in stub.requests] == ["messages", "prompt"]
    assert stub.requests[1].prompt == "The capital of France is"


def test_no_chat_sends_raw_text_and_chat_insists_on_the_template(capsys: pytest.CaptureFixture[str]) -> None:
    stub = FakeStub(has_template=False)
    assert run(["--no-chat", "--max-tokens", "8", "Once upon"], stub) == 0
    assert [r.WhichOneof("input") for r in stub.requests] == ["prompt"]
    assert stub.requests[0].sampling.max_tokens == 8
    assert run(["--chat", "Hello"], FakeStub(has_template=False)) == 1
    assert NO_CHAT_TEMPLATE in capsys.readouterr().err


def test_another_refusal_of_the_messages_is_not_retried_as_text() -> None:
    stub = FakeStub(has_template=False, refusal="messages: 90000 characters cannot fit in max_model_len 2048")
    assert run(["x" * 10], stub) == 1
    assert len(stub.requests) == 1


def test_help_says_the_defaults() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--no-chat" in text and "chat template when the model has one" in text
    assert f"default {DEFAULT_MAX_TOKENS}" in text
