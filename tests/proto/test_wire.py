from __future__ import annotations

import gc
from datetime import timedelta

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.wire import (
    MAX_MESSAGE_BYTES,
    WIRE_VERSION,
    Assignment,
    CachedRequest,
    Heartbeat,
    Interrupt,
    NewRequest,
    SamplingOptions,
    Shutdown,
    StepError,
    StepPlan,
    StepResult,
    StructuredOutput,
    TokenLogprobs,
    WireError,
    WorkerHello,
    WorkerReady,
    decode,
    encode,
    pack_int32,
    unpack_int32,
)
from tests.support.fuzz import mutated, refused_within_bounds, unpacked, with_a_field_changed

pytestmark = pytest.mark.unit

MESSAGES = [
    WorkerHello("host", 123, "cpu"),
    Assignment(0, 2, "/models/x", "auto", 16, 2048, 128, 2, 1, "127.0.0.2:29500", "cuda:1", 60.0),
    WorkerReady(1, 1000, 123456789, 64, 2.5e9, "int8"),
    Shutdown("bye"),
    StepPlan(
        7,
        [NewRequest(0, [1, 2, 3], [4], SamplingOptions(0.7, 0.9, 5, 42, 2), [3, 4], 0, 4)],
        [CachedRequest(1, 17, 1, (9,), (42,)), CachedRequest(4, 3, 2)],
        [2],
        [3],
        [(1, 0)],
        [(2, 5)],
        [(0, 6)],
        {1: [(0, 7)]},
    ),
    StepResult(7, {0: [5]}, {0: [TokenLogprobs(-0.5, [(5, -0.5), (6, -1.5)])]}, 3.25, 0.5),
    StepResult(8, {}, {}, 1.0, 0.0, interrupted=True),
    StepResult(9, {}, {}, 1.0, 0.0, prompt_logprobs={0: (3, [TokenLogprobs(-2.0, [(7, -0.1)])])}),
    StepResult(10, {}, token_handles=pack_int32([3, 0, 70000]), tokens=pack_int32([49151, 5, 0])),
    Interrupt(7, 9),
    Heartbeat(0, 3, 5.0),
    StepError(7, 0, "no"),
    StepPlan(
        10,
        [
            NewRequest(
                5,
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
                2,
            )
        ],
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert decode(encode(message)) == message  # type: ignore[arg-type]


def frame(*message: object) -> bytes:
    return msgpack.packb([WIRE_VERSION, list(message)])


def test_wrong_version_and_kind_are_rejected() -> None:
    with pytest.raises(WireError, match="version"):
        decode(msgpack.packb([WIRE_VERSION + 1, [6, "x"]]))
    with pytest.raises(WireError, match="wire version 4"):
        decode(msgpack.packb([4, 6, "x"]))  # a v4 peer's flat frame
    with pytest.raises(WireError, match="kind 99"):
        decode(frame(99, "x"))


def test_wrong_field_types_are_rejected_naming_the_field() -> None:
    with pytest.raises(WireError, match="WorkerReady: rank: Expected `int`, got `str`"):
        decode(frame(3, "rank", 1, 2))
    with pytest.raises(WireError, match=r"StepResult: sampled\[\.\.\.\]\[0\]: Expected `int`"):
        decode(frame(5, 1, {0: ["x"]}, {}, 0.0, 0.0))  # tokens must be ints
    with pytest.raises(WireError, match="sampled key: Expected `int`"):
        decode(frame(5, 1, {"a": [1]}))  # requests are handles
    with pytest.raises(WireError, match=r"cached_requests\[0\]\.new_token_ids\[0\]: Expected `int`, got `float`"):
        decode(frame(4, 1, [], [[0, 3, 1, [], [1.5]]]))  # a cached request's new tokens must be ints
    with pytest.raises(WireError, match=r"cached_requests\[0\]\.num_scheduled_tokens: Expected `int` >= 1"):
        decode(frame(4, 1, [], [[0, 3, 0]]))
    with pytest.raises(WireError, match=r"cached_requests\[1\]\.draft_token_ids: 2 in request 4's 2 scheduled"):
        decode(frame(4, 1, [], [[0, 3, 1], [4, 3, 2, [], [], [7, 8]]]))  # the first scheduled token must be known
    with pytest.raises(WireError, match="Heartbeat: timeout_s"):
        decode(frame(7, 0, 1, float("nan")))
    with pytest.raises(WireError, match="at most length"):
        decode(frame(9, 1, 2, 3))  # a field too many


def test_packed_tokens_read_as_the_map_of_lists() -> None:
    """A result of one token per request packs them (two int32 bins); its readers see what `sampled` would say."""
    packed = decode(encode(StepResult(3, {}, token_handles=pack_int32([9, 2]), tokens=pack_int32([300, 49151]))))
    assert isinstance(packed, StepResult)
    assert list(packed.sampled_items()) == [(9, [300]), (2, [49151])]
    assert (packed.tokens_of(2), packed.tokens_of(5)) == ([49151], None)
    plain = StepResult(3, {9: [300], 2: [1, 2]})
    assert list(plain.sampled_items()) == [(9, [300]), (2, [1, 2])] and plain.tokens_of(2) == [1, 2]
    assert unpack_int32(pack_int32([-1, 2**31 - 1])) == [-1, 2**31 - 1]


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"token_handles": pack_int32([1, 2]), "tokens": pack_int32([5])}, "one int32 each per request"),
        ({"token_handles": b"abc", "tokens": b"abc"}, "one int32 each per request"),
        ({"token_handles": pack_int32([1]), "tokens": pack_int32([5]), "sampled": {1: [5]}}, "not both"),
    ],
)
def test_malformed_packed_tokens_are_rejected(fields: dict, error: str) -> None:
    sampled = fields.pop("sampled", {})
    with pytest.raises(WireError, match=f"malformed StepResult: .*{error}"):
        decode(encode(StepResult(1, sampled, **fields)))


@pytest.mark.parametrize(
    ("rank", "world", "tp", "pp", "init", "error"),
    [
        (0, 4, 2, 1, "h:1", "world_size 4 != tensor_parallel_size 2 x pipeline_parallel_size 1"),
        (4, 4, 2, 2, "h:1", "rank 4 is outside a world of 4"),
        (0, 2, 2, 1, "", "distributed_init must be host:port"),
        (0, 0, 0, 1, "", "tensor_parallel_size: Expected `int` >= 1"),
    ],
)
def test_inconsistent_assignment_is_rejected(rank: int, world: int, tp: int, pp: int, init: str, error: str) -> None:
    bad = Assignment(rank, world, "/m", "auto", 16, 64, 8, tp, pp, init)
    with pytest.raises(WireError, match=error):
        decode(encode(bad))


def test_malformed_sampling_options_are_rejected() -> None:
    good = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingOptions(structured=StructuredOutput("regex", "a+"))))
    for index, value, error in [
        (9, {1.5: 2.0}, "logit_bias key"),
        (10, [[1, "x"]], r"bad_words\[0\]\[1\]"),
        (14, ["grammar", "x"], "structured kind 'grammar'"),
    ]:
        bad = list(good)
        bad[index] = value
        with pytest.raises(WireError, match=error):
            decode(frame(4, 1, [[0, [1], [], bad, [0], 0, 1]]))


def test_a_steady_decode_costs_a_plan_a_few_bytes() -> None:
    """Handles, the token count in the request's own record, no empty maps: <= 24 bytes per decoding request."""
    decodes = [CachedRequest(handle, 8000 + handle, 1) for handle in range(70_000, 71_024)]
    per_request = (len(encode(StepPlan(1 << 40, cached_requests=decodes))) - len(encode(StepPlan(1 << 40)))) / 1024
    assert per_request <= 24, per_request


def test_messages_stay_out_of_the_garbage_collector() -> None:
    """Plans are trees: their records are not tracked, so thousands of them add nothing to a collection."""
    plan = decode(encode(MESSAGES[4]))
    assert isinstance(plan, StepPlan)
    assert not gc.is_tracked(plan) and not gc.is_tracked(plan.cached_requests[0])


def test_oversized_message_is_rejected() -> None:
    with pytest.raises(WireError, match="limit"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


# Fuzzing the decoder that faces the worker socket (tests/support/fuzz.py): whatever arrives, decode returns a
# message or raises WireError, within the deadline and with its allocation linear in the input.
FUZZ = settings(max_examples=300, deadline=timedelta(milliseconds=500), suppress_health_check=[HealthCheck.too_slow])
FRAMES = [encode(m) for m in MESSAGES]


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    refused_within_bounds(decode, data, WireError)


@FUZZ
@given(mutated(FRAMES))
def test_mutated_frames_are_refused_with_wire_error_only(data: bytes) -> None:
    refused_within_bounds(decode, data, WireError)


@pytest.mark.parametrize("frame", FRAMES, ids=[type(m).__name__ for m in MESSAGES])
@settings(FUZZ, max_examples=40)
@given(drawn=st.data())
def test_a_frame_with_any_value_in_a_field_is_a_message_or_wire_error(frame: bytes, drawn: st.DataObject) -> None:
    """Each kind of message on its own, so that each one's own rules (`check`) are reached."""
    changed = drawn.draw(with_a_field_changed(unpacked([frame])))
    message = refused_within_bounds(decode, changed, WireError)
    if message is not None:  # what got through passed every check: it encodes again, within the limit
        again = encode(message)  # compared as bytes: a float field may hold a NaN, which equals nothing
        assert encode(decode(again)) == again


@pytest.mark.parametrize("header", [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                                    b"\xdb\xff\xff\xff\xff"])  # fmt: skip
def test_a_frame_that_claims_gigabytes_is_refused_without_allocating_them(header: bytes) -> None:
    """An array, map, bin or str header of 4 Gi items in a frame of a few bytes: refused, not believed."""
    for data in (header, msgpack.packb([WIRE_VERSION, None])[:-1] + header, b"\x92" + bytes([WIRE_VERSION]) + header):
        assert refused_within_bounds(decode, data, WireError) is None


def test_every_kind_is_one_message() -> None:
    """The kinds table is read from the Structs' tags: each Kind names exactly one message."""
    from proto.wire import _BY_KIND, Kind

    assert sorted(_BY_KIND) == sorted(Kind) and all(_BY_KIND[k].__struct_config__.tag == k for k in Kind)
    assert _BY_KIND[Kind.PLAN] is StepPlan and _BY_KIND[Kind.INTERRUPT] is Interrupt
