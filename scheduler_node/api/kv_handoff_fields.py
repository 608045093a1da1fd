"""The doors' forms of disaggregated prefill/decode, checked into the engine's `kv_produce` / `KVSource`
(scheduler_node/core/kv/leases.py) and back: gRPC's `GenerateRequest.kv_handoff` / `GenerateResponse.kv_source`,
and the OpenAI door's `kv_transfer_params` (the lease in hex; an answer's also names the request id to abort)."""

from __future__ import annotations

from typing import Any

from proto import serving_pb2 as pb
from scheduler_node.api.openai_protocol import KVTransferParams
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.kv.leases import LEASE_BYTES, KVSource

MAX_ADDRESSES = 64  # producer ranks
MAX_SOURCE_BLOCKS = 1 << 20


def kv_fields(request: pb.GenerateRequest, n: int, serves_kv: bool) -> dict[str, Any]:
    """The RequestSpec fields a request's kv_handoff asks for ({} without one); InvalidField naming the field.
    `serves_kv`: this replica's workers serve leases (not --kv-role decode)."""
    if not request.HasField("kv_handoff"):
        return {}
    h = request.kv_handoff
    fields = list(h.addresses), bytes(h.lease), list(h.blocks)
    return checked_fields("kv_handoff", h.produce, *fields, n, serves_kv, tokens=h.tokens)


def http_kv_fields(params: KVTransferParams | None, n: int, serves_kv: bool, stream: bool) -> dict[str, Any]:
    """`kv_fields` for the OpenAI door's `kv_transfer_params` (its lease in hex; a produce is not streamed)."""
    if params is None:
        return {}
    try:
        lease = bytes.fromhex(params.lease)
    except ValueError:
        raise InvalidField("kv_transfer_params.lease", f"must be {2 * LEASE_BYTES} hex digits") from None
    if params.produce and stream:
        raise InvalidField("kv_transfer_params.produce", "a prefill for another replica is not streamed")
    fields = list(params.addresses), lease, list(params.blocks)
    return checked_fields("kv_transfer_params", params.produce, *fields, n, serves_kv)


def checked_fields(
    name: str,
    produce: bool,
    addresses: list[str],
    lease: bytes,
    blocks: list[int],
    n: int,
    serves_kv: bool,
    tokens: int = 0,
) -> dict[str, Any]:
    if produce:
        if addresses or lease or blocks:
            raise InvalidField(name, "produce asks for a lease; addresses, lease and blocks name one")
        if not serves_kv:
            raise InvalidField(f"{name}.produce", "this replica serves no KV to others (--kv-role decode)")
        if n != 1:
            raise InvalidField(f"{name}.produce", f"a prefill for another replica has n = 1, got {n}")
        return {"kv_produce": True}
    source = checked_source(name, addresses, lease, blocks, tokens)
    return {} if source is None else {"kv_source": source}


def read_source(h: pb.KVHandoff, name: str) -> KVSource | None:
    """Where a migrated sequence's KV waits, checked; None when `h` names nothing."""
    return checked_source(name, list(h.addresses), bytes(h.lease), list(h.blocks), h.tokens)


def checked_source(name: str, addresses: list[str], lease: bytes, blocks: list[int], tokens: int) -> KVSource | None:
    """Where KV waits (a prefill's, or a migrated sequence's), checked; None when nothing is named."""
    if not addresses and not lease and not blocks:
        return None
    if len(lease) != LEASE_BYTES:
        raise InvalidField(f"{name}.lease", f"must be {LEASE_BYTES} bytes, got {len(lease)}")
    if not 0 < len(addresses) <= MAX_ADDRESSES or any(not a or len(a) > 256 for a in addresses):
        raise InvalidField(f"{name}.addresses", f"1 to {MAX_ADDRESSES} HOST:PORT, each at most 256 characters")
    if len(blocks) > MAX_SOURCE_BLOCKS or any(b < 0 for b in blocks):
        raise InvalidField(f"{name}.blocks", f"at most {MAX_SOURCE_BLOCKS} block ids, each >= 0")
    if tokens < 0:
        raise InvalidField(f"{name}.tokens", f"must be >= 0, got {tokens}")
    return KVSource(tuple(addresses), lease, tuple(blocks), tokens)


def source_message(source: KVSource) -> pb.KVHandoff:
    return pb.KVHandoff(
        addresses=list(source.addresses), lease=source.lease, blocks=list(source.blocks), tokens=source.tokens
    )


def source_params(source: KVSource, request_id: str) -> dict[str, Any]:
    """An OpenAI answer's `kv_transfer_params`: the lease to pull, and the request id whose abort releases it."""
    return {
        "addresses": list(source.addresses),
        "lease": source.lease.hex(),
        "blocks": list(source.blocks),
        "request_id": request_id,
    }
