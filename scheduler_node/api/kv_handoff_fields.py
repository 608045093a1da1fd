"""The gRPC form of disaggregated prefill/decode (`GenerateRequest.kv_handoff`, `GenerateResponse.kv_source`):
checked into the engine's `kv_produce` / `KVSource` (scheduler_node/core/kv_handoff.py) and back."""

from __future__ import annotations

from typing import Any

from proto import serving_pb2 as pb
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.kv_handoff import LEASE_BYTES, KVSource

MAX_ADDRESSES = 64  # producer ranks
MAX_SOURCE_BLOCKS = 1 << 20


def kv_fields(request: pb.GenerateRequest, n: int, serves_kv: bool) -> dict[str, Any]:
    """The RequestSpec fields a request's kv_handoff asks for ({} without one); InvalidField naming the field.
    `serves_kv`: this replica's workers serve leases (not --kv-role decode)."""
    if not request.HasField("kv_handoff"):
        return {}
    h = request.kv_handoff
    if h.produce:
        if h.addresses or h.lease or h.blocks:
            raise InvalidField("kv_handoff", "produce asks for a lease; addresses, lease and blocks name one")
        if not serves_kv:
            raise InvalidField("kv_handoff.produce", "this replica serves no KV to others (--kv-role decode)")
        if n != 1:
            raise InvalidField("kv_handoff.produce", f"a prefill for another replica has n = 1, got {n}")
        return {"kv_produce": True}
    source = read_source(h, "kv_handoff")
    return {} if source is None else {"kv_source": source}


def read_source(h: pb.KVHandoff, name: str) -> KVSource | None:
    """Where KV waits (a prefill's, or a migrated sequence's), checked; None when `h` names nothing."""
    if not h.addresses and not h.lease and not h.blocks:
        return None
    if len(h.lease) != LEASE_BYTES:
        raise InvalidField(f"{name}.lease", f"must be {LEASE_BYTES} bytes, got {len(h.lease)}")
    if not 0 < len(h.addresses) <= MAX_ADDRESSES or any(not a or len(a) > 256 for a in h.addresses):
        raise InvalidField(f"{name}.addresses", f"1 to {MAX_ADDRESSES} HOST:PORT, each at most 256 characters")
    if len(h.blocks) > MAX_SOURCE_BLOCKS or any(b < 0 for b in h.blocks):
        raise InvalidField(f"{name}.blocks", f"at most {MAX_SOURCE_BLOCKS} block ids, each >= 0")
    if h.tokens < 0:
        raise InvalidField(f"{name}.tokens", f"must be >= 0, got {h.tokens}")
    return KVSource(tuple(h.addresses), bytes(h.lease), tuple(h.blocks), h.tokens)


def source_message(source: KVSource) -> pb.KVHandoff:
    return pb.KVHandoff(
        addresses=list(source.addresses), lease=source.lease, blocks=list(source.blocks), tokens=source.tokens
    )
