"""The KV events wire (proto/kv_events.py): batches and snapshots round-trip; another version, a short hash, an
unknown tier and garbage are refused with KVWireError, never half-read; fuzzed (tests/support/fuzz.py), the decoders
return a message or raise KVWireError, quickly and with their allocation linear in the input."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings

from proto.kv_events import (
    CLEARED,
    DEVICE,
    RAM,
    REMOVED,
    STORED,
    KVEventBatch,
    KVWireError,
    decode_batch,
    decode_snapshot,
    encode_batch,
    encode_snapshot,
)
from tests.support.fuzz import field_changed, random_or_mutated, refused_within_bounds

pytestmark = pytest.mark.unit

BS = 4
EPOCH = b"e" * 8


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def batch(seq: int, *events: tuple[int, int, bytes | None, bytes | None]) -> KVEventBatch:
    return decode_batch(encode_batch(EPOCH, seq, BS, list(events)))


def stored(i: int) -> tuple[int, int, bytes | None, bytes | None]:
    return (STORED, DEVICE, h(i), h(i - 1) if i else None)


def test_the_wire_round_trips_and_refuses_what_it_cannot_trust() -> None:
    b = batch(3, stored(1), (REMOVED, RAM, h(2), None), (CLEARED, DEVICE, None, None))
    assert (b.epoch, b.seq, b.block_size) == (EPOCH, 3, BS) and len(b.events) == 3
    with pytest.raises(KVWireError, match="version"):
        decode_batch(encode_batch(EPOCH, 1, BS, []).replace(b"\x95\x01", b"\x95\x02", 1))
    with pytest.raises(KVWireError, match="KVEventBatch"):
        decode_batch(encode_batch(EPOCH, 1, BS, [(STORED, DEVICE, b"short", None)]))
    with pytest.raises(KVWireError, match="KVEventBatch"):
        decode_batch(encode_batch(EPOCH, 1, BS, [(STORED, 7, h(1), None)]))  # no such tier
    with pytest.raises(KVWireError, match="KVSnapshot"):
        decode_snapshot(b"\x01")
    snapshot = decode_snapshot(encode_snapshot(EPOCH, 4, BS, [(RAM, h(1))]))
    assert (snapshot.seq, snapshot.entries) == (4, [(RAM, h(1))])


FUZZ = settings(max_examples=200, deadline=timedelta(milliseconds=500), suppress_health_check=[HealthCheck.too_slow])
BATCHES = [
    encode_batch(EPOCH, 1, BS, []),
    encode_batch(EPOCH, 9, BS, [stored(1), stored(2), (REMOVED, RAM, h(2), None), (CLEARED, DEVICE, None, None)]),
]
SNAPSHOTS = [encode_snapshot(EPOCH, 0, BS, []), encode_snapshot(EPOCH, 4, BS, [(RAM, h(1)), (DEVICE, h(2))])]
DECODERS = [(decode_batch, BATCHES), (decode_snapshot, SNAPSHOTS)]


@FUZZ
@given(random_or_mutated(DECODERS))
def test_random_and_mutated_messages_are_refused_with_kv_wire_error_only(
    case: tuple[Callable[[bytes], object], bytes],
) -> None:
    decoder, data = case
    refused_within_bounds(decoder, data, KVWireError)


@FUZZ
@given(field_changed(DECODERS))
def test_a_message_with_any_value_in_a_field_is_read_whole_or_refused(
    case: tuple[Callable[[bytes], object], bytes],
) -> None:
    decoder, data = case
    message = refused_within_bounds(decoder, data, KVWireError)
    if isinstance(message, KVEventBatch):  # what got through holds only events of the schema
        assert all(kind <= CLEARED and (e_hash is None or len(e_hash) == 16) for kind, _, e_hash, _ in message.events)
