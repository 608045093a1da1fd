"""The KV events wire (proto/kv_events.py): batches and snapshots round-trip; another version, a short hash, an
unknown tier and garbage are refused with KVWireError, never half-read."""

from __future__ import annotations

import pytest

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
