"""KV blocks from one world's worker to another's: export a lease's blocks, import them into other block ids.

The producer rank runs a `KVExporter`: a ZeroMQ ROUTER socket served by a daemon thread, bound on loopback by
default, CURVE-authenticated with the worker socket's keys when `curve_dir` is set (`proto/curve.py`). Its owner
`grant`s a lease (a random secret naming some of its device blocks, which the owner keeps from being written) and
`revoke`s it; a complete pull (of every head, over pulls of head runs) revokes it too and calls `on_pulled`. A
consumer rank calls `pull_blocks`: it names the lease, the producer's blocks and its own destination blocks, and
receives them batched into chunks of at most
`max_chunk_bytes` (one raw frame per layer and tensor: keys, values, and the scales of an int8/fp8 cache), each
frame CRC-checked before it is written. Ranks pair only when their layouts agree (`proto/kv_transfer.py`): the
same KV format, block size, layers, KV heads and TP/PP place; anything else is refused before a byte moves. Between
worlds of different TP sizes a pull names a run of the producer rank's heads (`heads`), sent sliced and written
into a run of the consumer rank's heads (`dst_heads`).

This is the one export/import path: disaggregated prefill/decode uses it, and so may live migration. The API:
`cache_layout`, `export_frames` / `import_frames` (bytes of blocks, no socket), `KVExporter`, `pull_blocks`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from kernels.kv_quant import format_name
from proto.curve import configure_client, configure_server
from proto.kv_transfer import (
    DEFAULT_CHUNK_BYTES,
    KV_TRANSFER_VERSION,
    LEASE_BYTES,
    MAX_PULL_BYTES,
    HeadRun,
    KVChunk,
    KVLayout,
    KVPull,
    KVTransferError,
    decode_chunk,
    decode_pull,
    encode,
    pairing_problem,
)
from worker_node.kv_cache import KVCache

logger = logging.getLogger(__name__)

POLL_MS = 100


def new_lease() -> bytes:
    return secrets.token_bytes(LEASE_BYTES)


def cache_layout(
    cache: KVCache,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    model: str = "",
    total_kv_heads: int = 0,
) -> KVLayout:
    """The layout of this rank's device cache (the full pool; a compact pool's blocks are not exported).
    `total_kv_heads`: the model's (0: this rank's x `tp_size`, right unless KV heads are replicated)."""
    _n, block_size, heads, head_dim = cache[0].k.shape
    return KVLayout(
        format_name(cache[0].k.dtype), block_size, len(cache), heads, head_dim, tp_size, tp_rank,
        pp_size, pp_rank, model, total_kv_heads,
    )  # fmt: skip


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A cache tensor as uint8 rows, one per block (a view: writes go through)."""
    return t.view(torch.uint8).view(t.shape[0], -1)


def block_bytes(cache: KVCache, heads: HeadRun | None = None) -> int:
    """Bytes of one block over this rank's layers and tensors (of a run of its heads): what a transfer moves."""
    share = heads[1] / cache[0].k.shape[2] if heads is not None else 1
    return int(sum(_byte_rows(t).shape[1] for layer in cache for t in layer.tensors()) * share)


def _head_slice(t: torch.Tensor, heads: HeadRun | None) -> torch.Tensor:
    """A cache tensor ([N, block_size, heads, ...]) narrowed to a run of its heads (a view)."""
    return t if heads is None else t.narrow(2, heads[0], heads[1])


def export_frames(cache: KVCache, blocks: Sequence[int], heads: HeadRun | None = None) -> list[np.ndarray]:
    """The blocks' bytes (of a run of this rank's KV heads), one contiguous `[len(blocks), bytes]` array per layer
    and tensor, in cache order."""
    index = torch.tensor(list(blocks), dtype=torch.long, device=cache[0].k.device)
    return [
        _byte_rows(_head_slice(t, heads).index_select(0, index).contiguous()).cpu().numpy()
        for layer in cache
        for t in layer.tensors()
    ]


def import_frames(
    cache: KVCache,
    blocks: Sequence[int],
    frames: Sequence[memoryview | bytes | np.ndarray],
    heads: HeadRun | None = None,
) -> None:
    """Write frames (as `export_frames` makes them, for as many blocks) into these blocks of `cache` (into a run of
    its KV heads)."""
    tensors = [t for layer in cache for t in layer.tensors()]
    if len(frames) != len(tensors):
        raise KVTransferError(f"{len(frames)} frames for a cache of {len(tensors)} tensors")
    index = torch.tensor(list(blocks), dtype=torch.long, device=cache[0].k.device)
    for t, frame in zip(tensors, frames, strict=True):
        data = torch.frombuffer(bytearray(frame) if isinstance(frame, bytes) else frame, dtype=torch.uint8)
        if heads is None:
            rows = _byte_rows(t)
            if data.numel() != len(blocks) * rows.shape[1]:
                raise KVTransferError(f"a frame of {data.numel()} bytes for {len(blocks)} blocks of {rows.shape[1]}")
            rows.index_copy_(0, index, data.view(len(blocks), -1).to(rows.device))
            continue
        part = _head_slice(t, heads)
        shape = (len(blocks), *part.shape[1:])
        if data.numel() != part[:1].numel() * part.element_size() * len(blocks):
            raise KVTransferError(f"a frame of {data.numel()} bytes for {len(blocks)} blocks of heads {heads}")
        part.index_copy_(0, index, data.view(t.dtype).view(shape).to(t.device))


class KVExporter:
    """Serves this rank's leased device blocks to other worlds' ranks (see the module's docstring)."""

    def __init__(
        self,
        cache: KVCache,
        layout: KVLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        curve_dir: str | Path | None = None,
        on_pulled: Callable[[bytes], None] | None = None,
    ) -> None:
        self.cache = cache
        self.layout = layout
        self.on_pulled = on_pulled
        self._leases: dict[bytes, frozenset[int]] = {}
        self._heads_pulled: dict[bytes, set[int]] = {}  # by lease: heads sent by pulls of head runs so far
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_PULL_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth: ThreadAuthenticator | None = None
        if curve_dir:
            authorized = configure_server(self._sock, curve_dir)
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(authorized))
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-exporter", daemon=True)
        self._thread.start()

    # ---- leases (the owner's side)

    def grant(self, lease: bytes, blocks: Sequence[int]) -> None:
        if len(lease) != LEASE_BYTES:
            raise ValueError(f"a lease is {LEASE_BYTES} bytes, got {len(lease)}")
        if any(not 0 <= b < self.cache[0].num_blocks for b in blocks):
            raise ValueError(f"lease blocks outside the cache's {self.cache[0].num_blocks}: {list(blocks)}")
        with self._lock:
            self._leases[lease] = frozenset(blocks)

    def revoke(self, lease: bytes) -> bool:
        """Forget a lease (freed, aborted or timed out); True when it was held."""
        with self._lock:
            self._heads_pulled.pop(lease, None)
            return self._leases.pop(lease, None) is not None

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._auth is not None:
            self._auth.stop()
        self._sock.close(linger=0)
        self._ctx.term()

    # ---- serving (the exporter's thread)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            try:
                parts = self._sock.recv_multipart()
            except zmq.ZMQError:
                continue
            if len(parts) != 2:
                continue  # a DEALER's pull is [identity, pull]; anything else is not ours to answer
            ident, data = parts
            try:
                self._answer(ident, data)
            except KVTransferError as exc:
                logger.warning("KV pull refused: %s", exc)
                self._send(ident, KVChunk(KV_TRANSFER_VERSION, error=str(exc), layout=self.layout, done=True), [])
            except zmq.ZMQError as exc:
                logger.warning("KV pull cut short: %s", exc)

    def _answer(self, ident: bytes, data: bytes) -> None:
        pull = decode_pull(data)
        heads = self._heads(pull)
        problem = pairing_problem(self.layout, pull.layout, by_heads=heads is not None)
        if problem:
            raise KVTransferError(problem)
        with self._lock:
            held = self._leases.get(pull.lease)
        if held is None:
            raise KVTransferError("unknown or expired KV lease")
        if not set(pull.blocks) <= held:
            raise KVTransferError(f"blocks {sorted(set(pull.blocks) - held)} are not in the lease")
        per_block = max(1, block_bytes(self.cache, heads))
        if per_block > pull.max_chunk_bytes:
            raise KVTransferError(f"one block is {per_block} bytes, over the pull's max_chunk_bytes")
        step = pull.max_chunk_bytes // per_block
        for first in range(0, max(1, len(pull.blocks)), step):
            ids = pull.blocks[first : first + step]
            with self._lock:  # a revoke waits for this read: once it returns, the blocks are not read again
                if pull.lease not in self._leases:
                    raise KVTransferError("the KV lease was revoked during the pull")
                frames = export_frames(self.cache, ids, heads) if ids else []
            done = first + step >= len(pull.blocks)
            sums = [zlib.crc32(f.data) for f in frames]
            self._send(ident, KVChunk(KV_TRANSFER_VERSION, "", self.layout, first, len(ids), sums, done), frames)
        if self._all_pulled(pull.lease, heads) and self.revoke(pull.lease) and self.on_pulled is not None:
            self.on_pulled(pull.lease)

    def _all_pulled(self, lease: bytes, heads: HeadRun | None) -> bool:
        """Whether every head of the lease's blocks has been sent (a consumer rank of another TP size takes a run)."""
        if heads is None:
            return True
        with self._lock:
            pulled = self._heads_pulled.setdefault(lease, set())
            pulled.update(range(heads[0], heads[0] + heads[1]))
            return len(pulled) >= self.layout.num_kv_heads

    def _heads(self, pull: KVPull) -> HeadRun | None:
        """The run of this rank's KV heads a pull asks for (None: all, the same TP shape on both sides)."""
        if not pull.heads:
            return None
        if len(pull.heads) != 2 or pull.heads[1] < 1 or sum(pull.heads) > self.layout.num_kv_heads:
            raise KVTransferError(f"heads {pull.heads}: not a run of this rank's {self.layout.num_kv_heads} KV heads")
        return pull.heads[0], pull.heads[1]

    def _send(self, ident: bytes, header: KVChunk, frames: list[np.ndarray]) -> None:
        self._sock.send_multipart([ident, encode(header), *(f.data for f in frames)], copy=False)


def pull_blocks(
    address: str,
    lease: bytes,
    cache: KVCache,
    layout: KVLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    timeout_s: float = 10.0,
    curve_dir: str | Path | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    heads: HeadRun | None = None,
    dst_heads: HeadRun | None = None,
) -> int:
    """Pull a lease's `src_blocks` from the exporter at `address` into `dst_blocks` of `cache`; return the bytes
    moved. Raise KVTransferError when refused, corrupted, cut short, or silent for `timeout_s`. Between worlds of
    different TP sizes: the producer rank's run of KV `heads` goes into this rank's run `dst_heads`."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_chunk_bytes + MAX_PULL_BYTES)
    if curve_dir:
        configure_client(sock, curve_dir)
    try:
        sock.connect(f"tcp://{address}")
        if (heads is None) != (dst_heads is None) or (heads is not None and heads[1] != dst_heads[1]):  # type: ignore[index]
            raise ValueError(f"heads {heads} do not fit destination heads {dst_heads}")
        run = list(heads) if heads is not None else []
        sock.send(encode(KVPull(KV_TRANSFER_VERSION, lease, layout, list(src_blocks), max_chunk_bytes, run)))
        return _receive(sock, cache, layout, list(dst_blocks), timeout_s, address, dst_heads)
    finally:
        sock.close(linger=0)


def _receive(
    sock: zmq.Socket,
    cache: KVCache,
    layout: KVLayout,
    dst: list[int],
    timeout_s: float,
    address: str,
    heads: HeadRun | None = None,
) -> int:
    moved, received = 0, 0
    while True:
        deadline = time.monotonic() + timeout_s
        if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            raise KVTransferError(f"the KV exporter at {address} was silent for {timeout_s:g} s")
        header, *frames = sock.recv_multipart(copy=False)
        chunk = decode_chunk(header.bytes)
        if chunk.error:
            raise KVTransferError(f"the KV exporter at {address} refused: {chunk.error}")
        by_heads = heads is not None
        problem: str | None = "no layout in the reply"
        if chunk.layout is not None:
            problem = pairing_problem(layout, chunk.layout, by_heads)
        if problem:
            raise KVTransferError(problem)
        if chunk.first != received or chunk.first + chunk.count > len(dst) or len(chunk.sums) != len(frames):
            raise KVTransferError(f"an out-of-order or malformed KV chunk from {address}")
        buffers = [f.buffer for f in frames]
        if any(zlib.crc32(b) != s for b, s in zip(buffers, chunk.sums, strict=True)):
            raise KVTransferError(f"a KV chunk from {address} failed its checksum")
        if chunk.count:
            import_frames(cache, dst[chunk.first : chunk.first + chunk.count], buffers, heads)
        moved += sum(len(b) for b in buffers)
        received += chunk.count
        if chunk.done:
            if received != len(dst):
                raise KVTransferError(f"the KV exporter at {address} sent {received} of {len(dst)} blocks")
            return moved
