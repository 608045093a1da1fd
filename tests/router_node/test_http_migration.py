"""Live migration at the router's HTTP door (router/http_migration.py): a replica's server-sent events pass whole
events at a time however the bytes arrive, a last `migrated` event is read as a Handback wherever the chunks split
it (one that is not well formed is refused), and a moved unstreamed answer's parts merge choice by choice."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from proto import serving_pb2 as pb
from router_node.http_migration import Handback, error_event, events, merged_answer

pytestmark = pytest.mark.unit

STATES = pb.ResumeState(sequences=[pb.SequenceState(index=1, output_token_ids=[3, 4])])
PARAMS = {"request_id": "cmpl-1", "states": base64.b64encode(STATES.SerializeToString()).decode()}
DATA = b'data: {"a": 1}\n\ndata: {"b": "x\\n\\ny"}\n\n'
MIGRATED = f"event: migrated\ndata: {json.dumps(PARAMS)}\n\n".encode()


class Chunks:
    """A response whose content arrives in the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.content = self

    async def readany(self) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def read(stream: bytes, cut: list[int]) -> list[bytes | Handback]:
    """`stream` split at `cut`, read as the router reads it."""
    bounds = [0, *cut, len(stream)]
    pieces = [stream[a:b] for a, b in zip(bounds, bounds[1:])]

    async def main() -> list[bytes | Handback]:
        return [piece async for piece in events(Chunks(pieces[1:]), pieces[0])]

    return asyncio.run(main())


@pytest.mark.parametrize("cut", [[], [3], [len(DATA) - 1], [len(DATA)], [len(DATA) + 5], [1, 9, 20, 40, 60]])
def test_whole_events_pass_and_the_migrated_one_is_read_wherever_it_is_split(cut: list[int]) -> None:
    pieces = read(DATA + MIGRATED, cut)
    *passed, handback = pieces
    assert b"".join(p for p in passed if isinstance(p, bytes)) == DATA
    assert all(isinstance(p, bytes) and p.endswith(b"\n\n") for p in passed), "never half an event"
    assert isinstance(handback, Handback)
    assert (handback.request_id, handback.states, handback.params) == ("cmpl-1", STATES, PARAMS)


def test_a_stream_without_a_migrated_event_passes_whole() -> None:
    stream = DATA + b"data: [DONE]\n\n"
    assert b"".join(p for p in read(stream, [5, 30]) if isinstance(p, bytes)) == stream
    assert read(MIGRATED, [4])[0] == Handback("cmpl-1", STATES, PARAMS), "a stream moved before its first token"


@pytest.mark.parametrize(
    "event",
    [
        b"event: migrated\ndata: {not json\n\n",
        b'event: migrated\ndata: {"request_id": "r", "states": "!!"}\n\n',
        b'event: migrated\ndata: {"states": ""}\n\n',
        b'event: migrated\ndata: {"request_id": "r", "states": ""}\n\n',  # no sequences
    ],
)
def test_a_migrated_event_that_is_not_well_formed_is_refused(event: bytes) -> None:
    with pytest.raises(ValueError, match="migrated event"):
        read(DATA + event, [])


def test_an_error_event_is_openais_error_body() -> None:
    body = json.loads(error_event(503, "gone").removeprefix(b"data: "))
    assert body["error"]["message"] == "gone" and body["error"]["type"] == "server_error"


def test_a_moved_answers_parts_are_merged_choice_by_choice() -> None:
    lp = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0}], "text_offset": [0]}
    first = {"id": "c", "choices": [{"index": 0, "text": " one", "logprobs": lp, "finish_reason": "stop"},
                                    {"index": 1, "text": " un", "logprobs": lp, "finish_reason": None}],
             "usage": {"completion_tokens": 3}}  # fmt: skip
    lp2 = {"tokens": ["b"], "token_logprobs": [-2.0], "top_logprobs": [{"b": -2.0}], "text_offset": [3]}
    rest = {"id": "c", "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None},
                                   {"index": 1, "text": " deux", "logprobs": lp2, "finish_reason": "length"}],
            "usage": {"completion_tokens": 5}}  # fmt: skip
    whole = merged_answer([first, rest])
    assert [(c["text"], c["finish_reason"]) for c in whole["choices"]] == [(" one", "stop"), (" un deux", "length")]
    assert whole["choices"][1]["logprobs"]["text_offset"] == [0, 3] and whole["usage"] == {"completion_tokens": 5}
    chat = [{"choices": [{"index": 0, "message": {"role": "assistant", "content": part},
                          "logprobs": {"content": [{"token": part}]}, "finish_reason": end}]}
            for part, end in (("Hello", None), (" there", "length"))]  # fmt: skip
    (choice,) = merged_answer(chat)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello there"} and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"content": [{"token": "Hello"}, {"token": " there"}]}
