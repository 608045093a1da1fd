"""The KV transfer messages (proto/kv_transfer.py) as a hostile peer sends them: a pull or an ack to an exporter's
port, a chunk to a consumer. Fuzzed (tests/support/fuzz.py), each decoder returns a message or raises
KVTransferError, quickly and with its allocation linear in the input; a pull or ack over the size limit is refused
before it is read."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings

from proto.kv_transfer import (
    KV_TRANSFER_VERSION,
    MAX_PULL_BYTES,
    KVChunk,
    KVLayout,
    KVPull,
    KVStaging,
    KVStagingAck,
    KVTransferError,
    decode_ack,
    decode_chunk,
    decode_pull,
    encode,
)
from tests.support.fuzz import field_changed, random_or_mutated, refused_within_bounds

pytestmark = pytest.mark.unit

V = KV_TRANSFER_VERSION
LEASE, IDENT = b"L" * 16, b"S" * 16
STAGING = KVStaging("shm", IDENT, [b"/minivllm-x"], 4096, [0, 64], [64, 64])
LAYOUT = KVLayout("int8", 16, 4, 2, 64, 2, 1, 1, 0, "model-fingerprint", 4)
PULLS = [
    encode(KVPull(V, LEASE, LAYOUT, [3, 1, 4, 1, 5])),
    encode(KVPull(V, LEASE, LAYOUT, [9, 2], 1 << 20, [0, 1], "host-id")),
]
CHUNKS = [
    encode(KVChunk(V, "", LAYOUT, 0, 2, [1, 2, 3, 4], False)),
    encode(KVChunk(V, "unknown or expired KV lease", LAYOUT, done=True)),
    encode(KVChunk(V, "", LAYOUT, 0, 2, [7, 8], True, STAGING)),
]
ACKS = [encode(KVStagingAck(V, LEASE, IDENT, True)), encode(KVStagingAck(V, LEASE, IDENT, False))]
DECODERS: list[tuple[Callable[[bytes], object], list[bytes]]] = [
    (decode_pull, PULLS),
    (decode_chunk, CHUNKS),
    (decode_ack, ACKS),
]
FUZZ = settings(max_examples=200, deadline=timedelta(milliseconds=500), suppress_health_check=[HealthCheck.too_slow])


def test_the_messages_round_trip() -> None:
    for decoder, frames in DECODERS:
        for data in frames:
            assert encode(decoder(data)) == data  # type: ignore[arg-type]


@pytest.mark.parametrize("decoder", [decode_pull, decode_ack])
def test_a_pull_or_ack_over_the_limit_is_refused_before_it_is_read(decoder: Callable[[bytes], object]) -> None:
    with pytest.raises(KVTransferError, match="limit"):
        decoder(b"\x00" * (MAX_PULL_BYTES + 1))


@FUZZ
@given(random_or_mutated(DECODERS))
def test_random_and_mutated_messages_are_refused_with_kv_transfer_error_only(
    case: tuple[Callable[[bytes], object], bytes],
) -> None:
    decoder, data = case
    refused_within_bounds(decoder, data, KVTransferError)


@FUZZ
@given(field_changed(DECODERS))
def test_a_message_with_any_value_in_a_field_is_read_whole_or_refused(
    case: tuple[Callable[[bytes], object], bytes],
) -> None:
    decoder, data = case
    message = refused_within_bounds(decoder, data, KVTransferError)
    if isinstance(message, KVPull):  # what got through is of the schema: the exporter may trust its types
        assert len(message.lease) == 16 and all(isinstance(b, int) and b >= 0 for b in message.blocks)
