from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.wire import (
    MAX_MESSAGE_BYTES,
    WIRE_VERSION,
    Assignment,
    CachedRequest,
    Interrupt,
    NewRequest,
    SamplingOptions,
    Shutdown,
    StepPlan,
    StepResult,
    StructuredOutput,
    TokenLogprobs,
    WireError,
    WorkerHello,
    WorkerReady,
    decode,
    encode,
)

MESSAGES = [
    WorkerHello("host", 123, "cpu"),
    Assignment(0, 2, "/models/x", "auto", 16, 2048, 128, 2, 1, "127.0.0.2:29500", "cuda:1", 60.0),
    WorkerReady(1, 1000, 123456789, 64, 2.5e9, "int8"),
    Shutdown("bye"),
    StepPlan(
        7,
        [NewRequest("a", [1, 2, 3], [4], SamplingOptions(0.7, 0.9, 5, 42, 2), [3, 4], 0)],
        [CachedRequest("b", [9], 17, [42]), CachedRequest("e", [], 3)],
        {"a": 4, "b": 1, "e": 2},
        ["c"],
        ["d"],
        [(1, 0)],
        [(2, 5)],
        [(0, 6)],
        {"b": [(0, 7)]},
    ),
    StepResult(7, {"a": [5]}, {"a": [TokenLogprobs(-0.5, [(5, -0.5), (6, -1.5)])]}, 3.25, 0.5),
    StepResult(8, {}, {}, 1.0, 0.0, interrupted=True),
    StepResult(9, {}, {}, 1.0, 0.0, prompt_logprobs={"a": (3, [TokenLogprobs(-2.0, [(7, -0.1)])])}),
    Interrupt(7, 9),
    StepPlan(
        10,
        [
            NewRequest(
                "f",
                [1, 2],
                [],
                SamplingOptions(
                    0.5,
                    0.8,
                    3,
                    None,
                    None,
                    min_p=0.1,
                    repetition_penalty=1.2,
                    frequency_penalty=-0.5,
                    presence_penalty=1.5,
                    logit_bias={5: -100.0, 9: 2.5},
                    bad_words=[[4], [6, 7]],
                    min_tokens=3,
                    stop_token_ids=[2, 11],
                    prompt_logprobs=2,
                    structured=StructuredOutput("json", '{"type": "object"}'),
                ),
                [0],
                0,
            )
        ],
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert decode(encode(message)) == message  # type: ignore[arg-type]


def test_wrong_version_and_kind_are_rejected() -> None:
    with pytest.raises(WireError, match="version"):
        decode(msgpack.packb([WIRE_VERSION + 1, 6, "x"]))
    with pytest.raises(WireError, match="kind"):
        decode(msgpack.packb([WIRE_VERSION, 99, "x"]))


def test_wrong_field_types_are_rejected() -> None:
    with pytest.raises(WireError):
        decode(msgpack.packb([WIRE_VERSION, 3, "rank", 1, 2]))  # WorkerReady.rank must be an int
    with pytest.raises(WireError):
        decode(msgpack.packb([WIRE_VERSION, 5, 1, {"a": ["x"]}, {}, 0.0, 0.0]))  # tokens must be ints
    plan = StepPlan(1, cached_requests=[CachedRequest("b", [], 3, [1])]).to_wire()
    plan[2][0][3] = [1.5]
    with pytest.raises(WireError, match="new_token_ids"):
        decode(msgpack.packb([WIRE_VERSION, 4, *plan]))  # a cached request's new tokens must be ints


@pytest.mark.parametrize(
    ("rank", "world", "tp", "pp", "init", "error"),
    [
        (0, 4, 2, 1, "h:1", "world_size 4 != tensor_parallel_size 2 x pipeline_parallel_size 1"),
        (4, 4, 2, 2, "h:1", "rank 4 is outside a world of 4"),
        (0, 2, 2, 1, "", "distributed_init must be host:port"),
        (0, 0, 0, 1, "", "must be >= 1"),
    ],
)
def test_inconsistent_assignment_is_rejected(rank: int, world: int, tp: int, pp: int, init: str, error: str) -> None:
    bad = Assignment(rank, world, "/m", "auto", 16, 64, 8, tp, pp, init)
    with pytest.raises(WireError, match=error):
        decode(encode(bad))


def test_malformed_sampling_options_are_rejected() -> None:
    good = SamplingOptions(structured=StructuredOutput("regex", "a+")).to_wire()
    for index, value, error in [
        (9, [[1.5, 2.0]], "logit_bias token"),
        (10, [[1, "x"]], "bad_words"),
        (14, ["grammar", "x"], "structured kind"),
    ]:
        bad = list(good)
        bad[index] = value
        plan = StepPlan(1, [NewRequest("a", [1], [], SamplingOptions(), [0], 0)]).to_wire()
        plan[1][0][3] = bad
        with pytest.raises(WireError, match=error):
            decode(msgpack.packb([WIRE_VERSION, 4, *plan]))


def test_oversized_message_is_rejected() -> None:
    with pytest.raises(WireError, match="limit"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        decode(data)
    except WireError:
        pass
