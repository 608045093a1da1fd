"""The consumer's side of a KV pull (exporter.py has the producer's and the overview): one request
over a DEALER socket, then frames (CRC-checked chunks) or, from an exporter of this host, one staging buffer to map,
copy from and ack (staging.py). A staging buffer this process cannot open is acked as unusable and
the pull asked again by frames.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from pathlib import Path

import msgspec
import torch
import zmq

from proto.curve import configure_client
from proto.kv_transfer import (
    ACK_MARK,
    DEFAULT_CHUNK_BYTES,
    KV_TRANSFER_VERSION,
    MAX_PULL_BYTES,
    HeadRun,
    KVChunk,
    KVLayout,
    KVPull,
    KVStaging,
    KVStagingAck,
    KVTransferError,
    decode_chunk,
    encode,
    pairing_problem,
)
from worker_node.kv.cache import KVCache
from worker_node.kv.transfer.frames import import_frames
from worker_node.kv.transfer.staging import StagingError, host_id, open_staging

logger = logging.getLogger(__name__)


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
    same_host: bool = True,
) -> int:
    """Pull a lease's `src_blocks` from the exporter at `address` into `dst_blocks` of `cache`; return the bytes
    moved. Raise KVTransferError when refused, corrupted, cut short, or silent for `timeout_s`. Between worlds of
    different TP sizes: the producer rank's run of KV `heads` goes into this rank's run `dst_heads`. `same_host`:
    ask for a staging buffer (granted only by an exporter of this host); frames when refused or unusable here."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    if (heads is None) != (dst_heads is None) or (heads is not None and heads[1] != dst_heads[1]):  # type: ignore[index]
        raise ValueError(f"heads {heads} do not fit destination heads {dst_heads}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_chunk_bytes + MAX_PULL_BYTES)
    if curve_dir:
        configure_client(sock, curve_dir)
    pull = _Pull(sock, address, lease, cache, layout, list(dst_blocks), timeout_s, dst_heads)
    try:
        sock.connect(f"tcp://{address}")
        run = list(heads) if heads is not None else []
        ask = KVPull(KV_TRANSFER_VERSION, lease, layout, list(src_blocks), max_chunk_bytes, run)
        if same_host and (here := host_id()):
            try:
                return pull.request(msgspec.structs.replace(ask, host=here))
            except StagingError as exc:  # granted, but not usable here (another /dev/shm, another GPU driver)
                logger.info("KV pull from %s by frames: %s", address, exc)
        return pull.request(ask)
    finally:
        sock.close(linger=0)


class _Pull:
    """The consumer's side of one pull over one socket: the request, then frames or a staging buffer."""

    def __init__(
        self,
        sock: zmq.Socket,
        address: str,
        lease: bytes,
        cache: KVCache,
        layout: KVLayout,
        dst: list[int],
        timeout_s: float,
        heads: HeadRun | None,
    ) -> None:
        self.sock, self.address, self.lease, self.cache, self.layout = sock, address, lease, cache, layout
        self.dst, self.timeout_s, self.heads = dst, timeout_s, heads

    def request(self, pull: KVPull) -> int:
        self.sock.send(encode(pull))
        moved, received = 0, 0
        while True:
            header, *frames = self._reply()
            chunk = self._chunk(header.bytes)
            if chunk.staging is not None:
                return self._staged(chunk, chunk.staging)
            if chunk.first != received or chunk.first + chunk.count > len(self.dst) or len(chunk.sums) != len(frames):
                raise KVTransferError(f"an out-of-order or malformed KV chunk from {self.address}")
            buffers = [f.buffer for f in frames]
            if any(zlib.crc32(b) != s for b, s in zip(buffers, chunk.sums, strict=True)):
                raise KVTransferError(f"a KV chunk from {self.address} failed its checksum")
            if chunk.count:
                import_frames(self.cache, self.dst[chunk.first : chunk.first + chunk.count], buffers, self.heads)
            moved += sum(len(b) for b in buffers)
            received += chunk.count
            if chunk.done:
                if received != len(self.dst):
                    raise KVTransferError(
                        f"the KV exporter at {self.address} sent {received} of {len(self.dst)} blocks"
                    )
                return moved

    def _reply(self) -> list[zmq.Frame]:
        if not self.sock.poll(int(self.timeout_s * 1000)):
            raise KVTransferError(f"the KV exporter at {self.address} was silent for {self.timeout_s:g} s")
        return self.sock.recv_multipart(copy=False)

    def _chunk(self, data: bytes) -> KVChunk:
        chunk = decode_chunk(data)
        if chunk.error:
            raise KVTransferError(f"the KV exporter at {self.address} refused: {chunk.error}")
        problem: str | None = "no layout in the reply"
        if chunk.layout is not None:
            problem = pairing_problem(self.layout, chunk.layout, self.heads is not None)
        if problem:
            raise KVTransferError(problem)
        return chunk

    def _staged(self, chunk: KVChunk, where: KVStaging) -> int:
        """Copy the blocks out of the producer's staging buffer, then ack (the producer frees it) and wait for the
        confirmation. A buffer this process cannot open raises StagingError after a failed ack (pull by frames)."""
        tensors = sum(len(layer.tensors()) for layer in self.cache)
        ends = [o + n for o, n in zip(where.offsets, where.sizes, strict=False)]
        if (
            chunk.first or chunk.count != len(self.dst) or not chunk.done or len(where.offsets) != tensors
            or len(where.sizes) != tensors or len(chunk.sums) not in (0, tensors) or max(ends, default=0) > where.size
            or (where.kind == "shm" and not chunk.sums)
        ):  # fmt: skip
            self._ack(where, ok=False)
            raise KVTransferError(f"a malformed KV staging reply from {self.address}")
        try:
            with open_staging(where.kind, where.handle, where.size, self.cache[0].k.device) as buffer:
                frames = [buffer[o : o + n] for o, n in zip(where.offsets, where.sizes, strict=True)]
                sums = [zlib.crc32(f.numpy().data) for f in frames] if chunk.sums else []
                if sums == chunk.sums:
                    import_frames(self.cache, self.dst, frames, self.heads)
                if buffer.is_cuda:  # the copies must be done before the buffer is let go (the producer reuses it)
                    torch.cuda.synchronize(buffer.device)
                del frames, buffer  # no view left: the mapping (or the IPC handle) closes as the block ends
        except (StagingError, KVTransferError):
            self._ack(where, ok=False)
            raise
        if sums != chunk.sums:
            self._ack(where, ok=False)
            raise KVTransferError(f"a KV staging buffer from {self.address} failed its checksum")
        self._ack(where, ok=True)
        return sum(where.sizes)

    def _ack(self, where: KVStaging, ok: bool) -> None:
        ack = KVStagingAck(KV_TRANSFER_VERSION, self.lease, where.ident, ok)
        self.sock.send_multipart([ACK_MARK, encode(ack)])
        try:
            self._chunk(self._reply()[0].bytes)
        except KVTransferError as exc:  # the blocks are in (and checked): a lost confirmation costs nothing here
            logger.warning("KV staging ack to %s: %s", self.address, exc)
