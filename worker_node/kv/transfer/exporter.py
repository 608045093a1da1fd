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

Same host (staging.py): a consumer asks with its host id and a producer of the same host copies the
blocks into a staging buffer the consumer maps (/dev/shm on CPU, a CUDA IPC handle on GPU) instead of sending
frames; the consumer copies them into its blocks and acks, and the producer frees the buffer on that ack, on the
lease's revoke and at close. Frames over TCP remain the fallback: other hosts, a buffer that cannot be made or
opened, a pull beyond `staging_limit`, or `same_host=False` on either side. An acked /dev/shm buffer is kept,
renamed, for the next pull (one spare: fresh pages cost more to fault in than to copy into).

This is the one export/import path: disaggregated prefill/decode uses it, and so may live migration. The API:
`cache_layout`, `export_frames` / `import_frames` (bytes of blocks, no socket: worker_node/kv/transfer/frames.py),
`KVExporter`, `pull_blocks` (the consumer's side: worker_node/kv/transfer/pull.py).
"""

from __future__ import annotations

import logging
import secrets
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from proto.curve import configure_server
from proto.drop_log import DropLog
from proto.kv_transfer import (
    ACK_MARK,
    KV_TRANSFER_VERSION,
    LEASE_BYTES,
    MAX_PULL_BYTES,
    STAGING_ID_BYTES,
    HeadRun,
    KVChunk,
    KVLayout,
    KVPull,
    KVStaging,
    KVTransferError,
    decode_ack,
    decode_pull,
    encode,
    pairing_problem,
)
from worker_node.kv.cache import KVCache
from worker_node.kv.transfer.frames import (
    block_bytes,
    cache_layout,
    export_frames,
    export_into,
    import_frames,
    staging_bytes,
)
from worker_node.kv.transfer.pull import pull_blocks
from worker_node.kv.transfer.staging import Staging, StagingError, host_id, make_staging

__all__ = ["KVExporter", "block_bytes", "cache_layout", "export_frames", "import_frames", "new_lease", "pull_blocks"]

logger = logging.getLogger(__name__)

POLL_MS = 100
DEFAULT_STAGING_LIMIT = 2 * 1024**3  # bytes of staging buffers an exporter holds at once; beyond: frames


def new_lease() -> bytes:
    return secrets.token_bytes(LEASE_BYTES)


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
        same_host: bool = True,
        staging_limit: int = DEFAULT_STAGING_LIMIT,
    ) -> None:
        self.cache = cache
        self.layout = layout
        self.on_pulled = on_pulled
        self.host = host_id() if same_host else ""  # "": every pull gets frames
        self.staging_limit = staging_limit
        self._staged: dict[bytes, tuple[bytes, Staging, HeadRun | None]] = {}  # by id: lease, buffer, heads
        self._spare: Staging | None = None  # an acked /dev/shm buffer, renamed, for the next pull (until close)
        self.pulls_staged = 0  # pulls answered with a staging buffer / with frames (read by tests and benchmarks)
        self.pulls_framed = 0
        # Pulls and acks refused or dropped (malformed, unknown lease, ...): anyone who reaches the port may send
        # them (without CURVE), so they are counted and logged at a bounded rate (proto/drop_log.py).
        self.drops = DropLog("kv_transfer", logger)
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
        """Forget a lease (freed, aborted or timed out) and free its staging buffers; True when it was held."""
        with self._lock:
            self._heads_pulled.pop(lease, None)
            held = self._leases.pop(lease, None) is not None
            gone = [i for i, (owner, _, _) in self._staged.items() if owner == lease]
            buffers = [self._staged.pop(i)[1] for i in gone]
        for b in buffers:
            b.free()
        return held

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def num_staged(self) -> int:
        """Staging buffers handed out and not yet acked (nor revoked)."""
        with self._lock:
            return len(self._staged)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.drops.flush()
        with self._lock:
            buffers = [b for _, b, _ in self._staged.values()] + ([self._spare] if self._spare else [])
            self._staged.clear()
            self._spare = None
        for b in buffers:
            b.free()
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
            if len(parts) == 3 and parts[1] == ACK_MARK:
                ident, data = parts[0], parts[2]
                handle: Callable[[bytes, bytes], None] = self._acked
            elif len(parts) == 2:  # a DEALER's pull is [identity, pull]; anything else is not ours to answer
                ident, data = parts
                handle = self._answer
            else:
                self.drops.drop("a message of %d frames", len(parts))
                continue
            try:
                handle(ident, data)
            except KVTransferError as exc:
                self.drops.drop("KV pull refused: %s", exc)
                self._send(ident, KVChunk(KV_TRANSFER_VERSION, error=str(exc), layout=self.layout, done=True), [])
            except zmq.ZMQError as exc:
                logger.warning("KV pull cut short: %s", exc)
            except Exception as exc:  # noqa: BLE001 - one bad pull must not end the exporter (its pullers would hang)
                logger.exception("KV pull failed")
                self._send(ident, KVChunk(KV_TRANSFER_VERSION, error=f"exporter error: {exc}", done=True), [])

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
        if pull.host and pull.host == self.host and pull.blocks and self._staged_reply(ident, pull, heads):
            return
        self.pulls_framed += 1
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

    def _staged_reply(self, ident: bytes, pull: KVPull, heads: HeadRun | None) -> bool:
        """Answer a same-host pull with a staging buffer holding its blocks; False (frames instead) when no buffer
        can be made or the pull would take this exporter past `staging_limit`."""
        size = staging_bytes(self.cache, len(pull.blocks), heads)
        with self._lock:
            held = sum(b.size for _, b, _ in self._staged.values())
        if held + size > self.staging_limit:
            return False
        try:
            staging = self._buffer(size)
        except StagingError as exc:
            logger.info("KV pull by frames: %s", exc)
            return False
        ident_bytes = secrets.token_bytes(STAGING_ID_BYTES)
        with self._lock:  # as for frames: a revoke waits for this read
            if pull.lease not in self._leases:
                staging.free()
                raise KVTransferError("the KV lease was revoked during the pull")
            places, sums = self._fill(staging, pull.blocks, heads)
            self._staged[ident_bytes] = (pull.lease, staging, heads)
        offsets, sizes = [o for o, _ in places], [n for _, n in places]
        where = KVStaging(staging.kind, ident_bytes, staging.handle, size, offsets, sizes)
        n = len(pull.blocks)
        self.pulls_staged += 1
        self._send(ident, KVChunk(KV_TRANSFER_VERSION, "", self.layout, 0, n, sums, True, where), [])
        return True

    def _buffer(self, size: int) -> Staging:
        """A staging buffer of at least `size` bytes: the spare when it is big enough (its pages are in: a busy host
        spends longer faulting fresh pages in than copying into them), else a new one."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.size >= size:
            return spare
        if spare is not None:
            spare.free()
        return make_staging(size, self.cache[0].k.device)

    def _release(self, staging: Staging) -> None:
        """A buffer its consumer acked: kept as the spare under a new random name when it is a /dev/shm one and there
        is none (the name the consumer knew opens nothing any more), else freed."""
        if staging.kind == "shm" and self._spare is None:
            try:
                staging.rename()
            except OSError:
                staging.free()
                return
            with self._lock:
                self._spare = staging
            return
        staging.free()

    def _fill(
        self, staging: Staging, blocks: Sequence[int], heads: HeadRun | None
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Copy the blocks into the buffer: each frame's (offset, bytes), and CRC-32s on CPU. None on a GPU: a CRC
        there would copy every byte to the host, which is what the staging avoids, and the bytes never leave the
        device's memory (no wire to corrupt them; the handle itself comes over the authenticated socket)."""
        places = export_into(self.cache, blocks, staging.tensor, heads)
        if staging.kind != "shm":
            # the copies land before the consumer (another process, another stream) hears of the buffer
            torch.cuda.synchronize(staging.tensor.device)
            return places, []
        data = staging.tensor.numpy()
        return places, [zlib.crc32(data[o : o + n].data) for o, n in places]

    def _acked(self, ident: bytes, data: bytes) -> None:
        """A consumer is done with a staging buffer: free it, count the pull when it went well, confirm."""
        ack = decode_ack(data)
        with self._lock:
            entry = self._staged.get(ack.ident)
            if entry is not None and entry[0] == ack.lease:
                del self._staged[ack.ident]
        if entry is None or entry[0] != ack.lease:
            raise KVTransferError("an ack of an unknown staging buffer (revoked or already acked)")
        _, staging, heads = entry
        self._release(staging)
        if ack.ok and self._all_pulled(ack.lease, heads) and self.revoke(ack.lease) and self.on_pulled is not None:
            self.on_pulled(ack.lease)
        self._send(ident, KVChunk(KV_TRANSFER_VERSION, "", self.layout, done=True), [])  # after: nothing left

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
