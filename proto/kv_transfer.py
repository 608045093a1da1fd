"""The worker ⇄ worker KV transfer messages: a consumer pulls a lease's blocks from a producer rank.

One pull is one request and a few large replies. The consumer (a DEALER) sends a `KVPull`: the lease's secret,
which of the lease's blocks it wants, its own `KVLayout` and the largest reply it takes. The producer (a ROUTER)
answers with `KVChunk` headers, each followed by one raw frame per (layer, tensor) holding a run of consecutive
requested blocks (keys, values and, when quantized, their scales), so a transfer is a handful of messages, not one
per 16-token block. Each frame carries a CRC-32 in its header; the last chunk says `done`. A refusal is a chunk
with `error` set (an unknown lease, blocks outside it, a layout that does not pair).

Pairing: both sides' layouts must agree on everything a block's bytes depend on (`pairing_problem` names the first
field that differs): KV format, block size, this rank's layers and KV heads, head size, and the TP/PP shape with
the rank's place in it (rank r of one world pulls from rank r of the other). Worlds of different TP sizes (the same
PP shape) pair head by head instead: a pull names a run of the producer rank's KV heads (`KVPull.heads`), the
model's KV heads must agree, and each consumer rank pulls its heads from the producer rank(s) holding them
(`head_sources`), slicing or concatenating them. msgpack only; no pickle.

Same host: a consumer that sends its host id (`KVPull.host`, worker_node/kv/transfer/staging.py `host_id`) asks for the
blocks in a staging buffer it can map instead of frames; a producer of the same host id may grant it (it may also
refuse, silently: it answers with frames as usual). The one reply then names the buffer (`KVChunk.staging`: its
kind, handle and each frame's offset and size) and carries no frames; the consumer copies from it and answers with
a `KVStagingAck` (sent as [`ACK_MARK`, ack]: `ok` false when it could not use the buffer and pulls again with
frames), which the producer confirms with a bare `done` chunk after freeing the buffer.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from proto.parallel import kv_head_range

KV_TRANSFER_VERSION = 2  # 2: same-host staging
MAX_PULL_BYTES = 1024 * 1024  # a KVPull: a lease, a layout and block ids
DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024  # the largest reply a consumer takes unless told otherwise
LEASE_BYTES = 16  # a lease's secret: whoever holds it may read the lease's blocks (over CURVE when configured)
STAGING_ID_BYTES = 16
ACK_MARK = b"ack"  # the frame before a KVStagingAck (a pull is a single frame)

Count = Annotated[int, Meta(ge=0)]


class KVTransferError(RuntimeError):
    """A pull failed: refused by the producer, cut short, corrupted, timed out, or the layouts do not pair."""


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """What one rank's block bytes mean: two ranks exchange blocks only when their layouts pair."""

    format: str  # kernels/kv_quant.py format_name: float32, bfloat16, int8, fp8_e4m3, ...
    block_size: Annotated[int, Meta(ge=1)]
    num_layers: Annotated[int, Meta(ge=1)]  # this rank's layers (its pipeline stage)
    num_kv_heads: Annotated[int, Meta(ge=1)]  # this rank's KV heads (its tensor-parallel slice)
    head_dim: Annotated[int, Meta(ge=1)]
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = 1
    tensor_rank: Count = 0
    pipeline_parallel_size: Annotated[int, Meta(ge=1)] = 1
    pipeline_rank: Count = 0
    model: str = ""  # the weights' fingerprint (worker_node/kv/tiers.py model_fingerprint); "" is not checked
    total_kv_heads: Count = 0  # the model's KV heads (0: num_kv_heads x TP size, right unless heads are replicated)

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads * self.tensor_parallel_size

    @property
    def head_range(self) -> tuple[int, int]:
        """[first, end) of the model's KV heads this rank holds."""
        return kv_head_range(self.model_kv_heads, self.tensor_parallel_size, self.tensor_rank)


HeadRun = tuple[int, int]  # (first, count) of a rank's own KV heads
_PER_RANK = ("num_kv_heads", "tensor_parallel_size", "tensor_rank", "total_kv_heads")


def pairing_problem(local: KVLayout, remote: KVLayout, by_heads: bool = False) -> str | None:
    """Why blocks of `remote` cannot be read as blocks of `local` (the first field that differs), or None.
    `by_heads`: a pull of a run of heads, between worlds whose TP sizes may differ (the model's KV heads must agree)."""
    for name in KVLayout.__struct_fields__:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if (name == "model" and not (mine and theirs)) or (by_heads and name in _PER_RANK):
            continue
        if mine != theirs:
            return f"KV layouts do not pair: {name} is {mine!r} here and {theirs!r} on the other side"
    if by_heads and local.model_kv_heads != remote.model_kv_heads:
        return (
            f"KV layouts do not pair: the model's KV heads are {local.model_kv_heads} here and "
            f"{remote.model_kv_heads} on the other side"
        )
    return None


def head_sources(local: KVLayout, producer_tp: int) -> list[tuple[int, HeadRun, HeadRun]]:
    """Where this rank's KV heads are in a producer world of `producer_tp` ranks per stage: (producer TP rank, its
    run of the producer rank's heads, where the run goes among this rank's heads), covering each head once (a
    replicated head is taken from the first rank holding it)."""
    first, end = local.head_range
    total = local.model_kv_heads
    runs: list[tuple[int, HeadRun, HeadRun]] = []
    covered = first
    for rank in range(producer_tp):
        p0, p1 = kv_head_range(total, producer_tp, rank)
        lo, hi = max(covered, p0), min(end, p1)
        if lo < hi:
            runs.append((rank, (lo - p0, hi - lo), (lo - first, hi - lo)))
            covered = hi
    return runs


class KVPull(msgspec.Struct, frozen=True, array_like=True):
    version: int
    lease: Annotated[bytes, Meta(min_length=LEASE_BYTES, max_length=LEASE_BYTES)]
    layout: KVLayout  # the consumer's: the producer refuses one that does not pair
    blocks: list[Count]  # the producer's block ids, a subset of the lease's, in the order the consumer wants them
    max_chunk_bytes: Annotated[int, Meta(ge=1)] = DEFAULT_CHUNK_BYTES
    heads: list[Count] = []  # [first, count] of the producer rank's KV heads (worlds of other TP sizes); [] = all
    host: Annotated[str, Meta(max_length=512)] = ""  # the consumer's host id: asks for same-host staging; "" = frames


class KVStaging(msgspec.Struct, frozen=True, array_like=True):
    """Where a same-host reply's frames are: a buffer the consumer maps (worker_node/kv/transfer/staging.py)."""

    kind: str  # "shm" (a /dev/shm file) or "cuda" (a CUDA IPC handle)
    ident: Annotated[bytes, Meta(min_length=STAGING_ID_BYTES, max_length=STAGING_ID_BYTES)]  # for the ack
    handle: Annotated[list[bytes | int | bool], Meta(max_length=16)]  # shm: [name]; cuda: _share_cuda_()
    size: Count  # bytes of the buffer
    offsets: list[Count]  # of each (layer, tensor) frame in the buffer, in cache order
    sizes: list[Count]  # bytes of each frame


class KVStagingAck(msgspec.Struct, frozen=True, array_like=True):
    """The consumer is done with a staging buffer: the producer frees it (and, when `ok`, counts the pull)."""

    version: int
    lease: Annotated[bytes, Meta(min_length=LEASE_BYTES, max_length=LEASE_BYTES)]
    ident: Annotated[bytes, Meta(min_length=STAGING_ID_BYTES, max_length=STAGING_ID_BYTES)]
    ok: bool  # False: the consumer could not use the buffer (it pulls again with frames) or it was corrupt


class KVChunk(msgspec.Struct, frozen=True, array_like=True):
    version: int
    error: str = ""  # a refusal: the pull ends here
    layout: KVLayout | None = None  # the producer's (in the first chunk)
    first: Count = 0  # index into KVPull.blocks of this chunk's first block
    count: Count = 0  # blocks in this chunk
    sums: list[Count] = []  # CRC-32 of each raw frame after this header (or in the staging; none on a GPU)
    done: bool = False
    staging: KVStaging | None = None  # same host: the frames are in this buffer, not after the header


M = TypeVar("M", KVPull, KVChunk, KVStagingAck)

_pull_decoder = msgspec.msgpack.Decoder(KVPull)
_chunk_decoder = msgspec.msgpack.Decoder(KVChunk)
_ack_decoder = msgspec.msgpack.Decoder(KVStagingAck)


def encode(message: KVPull | KVChunk | KVStagingAck) -> bytes:
    return msgspec.msgpack.encode(message)


def decode_pull(data: bytes) -> KVPull:
    """A pull from a consumer (raise KVTransferError naming what is wrong: size, version, a field)."""
    if len(data) > MAX_PULL_BYTES:
        raise KVTransferError(f"a KV pull of {len(data)} bytes exceeds the {MAX_PULL_BYTES}-byte limit")
    return _check(_decode(_pull_decoder, data))


def decode_chunk(data: bytes) -> KVChunk:
    return _check(_decode(_chunk_decoder, data))


def decode_ack(data: bytes) -> KVStagingAck:
    if len(data) > MAX_PULL_BYTES:
        raise KVTransferError(f"a KV staging ack of {len(data)} bytes exceeds the {MAX_PULL_BYTES}-byte limit")
    return _check(_decode(_ack_decoder, data))


def _decode(decoder: msgspec.msgpack.Decoder[M], data: bytes) -> M:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise KVTransferError(f"malformed KV transfer message: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise KVTransferError(f"undecodable KV transfer message: {exc}") from exc


def _check(message: M) -> M:
    if message.version != KV_TRANSFER_VERSION:
        raise KVTransferError(f"KV transfer version {message.version}, this side speaks {KV_TRANSFER_VERSION}")
    return message
