"""KV events on the wire: a replica's prefix-cache changes (scheduler_node/core/kv/prefix_events.py) as msgpack, for the
router's `kv` strategy. Never pickle.

- A **batch** (the PUB socket, one message per engine step with changes, and a heartbeat when idle):
  `[version, epoch, seq, block_size, events]`. `epoch` is 8 random bytes drawn when the scheduler starts (a
  restarted replica has a new one), `seq` counts the batches of that epoch from 1 with no holes, each event is
  `[kind, tier, hash, parent]` (kinds and tiers in scheduler_node/core/kv/prefix_events.py).
- A **snapshot** (the ROUTER socket answers a `snapshot` request): `[version, epoch, seq, block_size, entries]`,
  every `[tier, hash]` held after batch `seq` was published.

A message is refused (KVWireError) when it is larger than MAX_KV_MESSAGE_BYTES, of another version, or not of the
schema: a subscriber that cannot read a batch treats it as lost and resynchronizes.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

# The tiers, as the offload tiers number them (scheduler_node/core/kv/tier_index.py: Tier), and the event kinds
# (scheduler_node/core/kv/prefix_events.py makes the events).
DEVICE, RAM, DISK = 0, 1, 2
TIERS = (DEVICE, RAM, DISK)
TIER_NAMES = {DEVICE: "device", RAM: "cpu", DISK: "disk"}
STORED, REMOVED, CLEARED = 0, 1, 2
# (kind, tier, hash, parent): (STORED, tier, hash, parent or None), (REMOVED, tier, hash, None), (CLEARED, tier,
# None, None). One shape for all three keeps the schema a plain typed list.
Event = tuple[int, int, "bytes | None", "bytes | None"]

KV_EVENTS_VERSION = 1
MAX_KV_MESSAGE_BYTES = 64 * 1024 * 1024  # a snapshot of ~2 million blocks; larger ones are cut (see snapshot())
MAX_EVENTS_PER_BATCH = 8192  # a step's events beyond this go out in several batches
HASH_BYTES = 16  # scheduler_node/core/kv/block_table.py: hash_block's digest size
SNAPSHOT_REQUEST = b"snapshot"

Hash = Annotated[bytes, Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
Tier = Annotated[int, Meta(ge=min(TIERS), le=max(TIERS))]
Kind = Annotated[int, Meta(ge=0, le=CLEARED)]


class KVWireError(ValueError):
    """A message that is not a valid KV events message."""


class KVEventBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    version: int
    epoch: bytes
    seq: Annotated[int, Meta(ge=1)]
    block_size: Annotated[int, Meta(ge=1)]
    events: list[tuple[Kind, Tier, Hash | None, Hash | None]]


class KVSnapshot(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    version: int
    epoch: bytes
    seq: Annotated[int, Meta(ge=0)]
    block_size: Annotated[int, Meta(ge=1)]
    entries: list[tuple[Tier, Hash]]


def encode_batch(epoch: bytes, seq: int, block_size: int, events: list[Event]) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(KV_EVENTS_VERSION, epoch, seq, block_size, events))  # type: ignore[arg-type]


def encode_snapshot(epoch: bytes, seq: int, block_size: int, entries: list[tuple[int, bytes]]) -> bytes:
    """The snapshot, cut to the first entries that fit MAX_KV_MESSAGE_BYTES (a router then knows fewer blocks
    than are held: it misses some hits, never routes on a block that is gone)."""
    fit = (MAX_KV_MESSAGE_BYTES - 1024) // (HASH_BYTES + 4)
    return msgspec.msgpack.encode(KVSnapshot(KV_EVENTS_VERSION, epoch, seq, block_size, entries[:fit]))


def decode_batch(data: bytes) -> KVEventBatch:
    return _decode(data, KVEventBatch)


def decode_snapshot(data: bytes) -> KVSnapshot:
    return _decode(data, KVSnapshot)


T = TypeVar("T", KVEventBatch, KVSnapshot)


def _decode(data: bytes, kind: type[T]) -> T:
    if len(data) > MAX_KV_MESSAGE_BYTES:
        raise KVWireError(f"KV events message of {len(data)} bytes is over the {MAX_KV_MESSAGE_BYTES} limit")
    try:
        message = msgspec.msgpack.decode(data, type=kind)
    except msgspec.DecodeError as exc:
        raise KVWireError(f"not a KV events {kind.__name__}: {exc}") from None
    if message.version != KV_EVENTS_VERSION:
        raise KVWireError(f"KV events version {message.version}; this side speaks {KV_EVENTS_VERSION}")
    return message
