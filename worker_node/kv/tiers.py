"""The worker's KV offload tiers: its shard of every offloaded block in host RAM and in a file on disk.

The scheduler owns the index (scheduler_node/core/kv/tier_index.py) and names slots; this rank only stores and copies.
Moves run in the order the plan lists them (a slot is always read before a later move overwrites it); runs of
moves between the same two tiers are batched.

The disk file (DIR/rank{r}.kvtier) survives a restart. Its header records what its blocks mean (format version,
the model's fingerprint, dtype, block size, this rank's layers and KV heads, the layout, the slot count); a file
whose header differs is ignored and started afresh, never loaded. Each slot holds the block's hash, a checksum
over hash and payload, and the payload: a slot whose checksum fails at start is left out of the index (the
block is recomputed). A load that fails later (a slot corrupted, truncated or unreadable since start) is reported
instead of feeding the model bad KV: the worker leaves the requests that read that block out of the step and the
scheduler forgets the block and has them compute it (scheduler_node/core/scheduler.py, `_recompute_failed_loads`).
A tier is a cache: a write that fails (a full disk, an I/O error) drops its block and is reported, never fails the
step; the scheduler then turns the disk tier off (scheduler_node/core/kv/tier_index.py, `drop_failed_stores`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from proto.wire import TierMove, WorkerReady
from worker_node.kv.cache import KVCache, copy_blocks

logger = logging.getLogger(__name__)

DEVICE, RAM, DISK = 0, 1, 2
MAGIC = b"minivllm-kv-tier\n"
FORMAT_VERSION = 2  # 2: a CRC-32 per block instead of blake2b-128 (a file of format 1 is started afresh)
HEADER_BYTES = 4096
HASH_BYTES = 16  # the scheduler's chained block hash (blake2b-128)
SUM_BYTES = 4


def model_fingerprint(folder: str | Path) -> str:
    """What identifies the weights: config.json's bytes and the name and size of every weight file."""
    folder = Path(folder)
    h = hashlib.blake2b((folder / "config.json").read_bytes(), digest_size=16)
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class DiskLayout:
    """Everything a disk block's bytes depend on: a file written under any other layout is never loaded."""

    model: str  # model_fingerprint
    dtype: str  # the KV cache's format (kernels/kv_quant.py format_name): bfloat16, int8, fp8_e4m3, ...
    block_size: int
    num_layers: int  # this rank's layers
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_slots: int
    payload_bytes: int  # one block over this rank's layers: keys, values and, when quantized, their scales

    @property
    def record_bytes(self) -> int:
        return HASH_BYTES + SUM_BYTES + self.payload_bytes

    def header(self) -> bytes:
        text = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True).encode()
        return (MAGIC + text).ljust(HEADER_BYTES, b"\0")


class DiskBlockUnreadable(RuntimeError):
    """A disk tier slot does not hold an intact copy of the block asked for (or could not be read)."""


def _checksum(block_hash: bytes, payload: bytes) -> bytes:
    """CRC-32 over hash and payload: it catches a flipped, torn or cut-short block (the file is this worker's own,
    mode 0600: corruption is the risk, not tampering) at a fifth of blake2b's cost, which was most of a disk load
    (scripts/bench_kv_offload.py)."""
    return zlib.crc32(payload, zlib.crc32(block_hash)).to_bytes(SUM_BYTES, "little")


class DiskTier:
    """Fixed-size slots in one file; slot i's record starts at HEADER_BYTES + i * record_bytes."""

    def __init__(self, path: Path, layout: DiskLayout) -> None:
        if len(layout.header()) > HEADER_BYTES:
            raise ValueError("disk tier header does not fit in its reserved bytes")
        self.path = path
        self.layout = layout
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.found: list[tuple[int, bytes]] = []  # intact blocks from an earlier run: (slot, hash)
        if os.pread(self._fd, HEADER_BYTES, 0) == layout.header():
            self.found = self._scan()
        else:
            if os.fstat(self._fd).st_size:
                logger.warning("%s was written for another model, dtype or layout: ignored, started afresh", path)
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, layout.header(), 0)
        size = HEADER_BYTES + layout.num_slots * layout.record_bytes
        room = shutil.disk_usage(path.parent).free + os.fstat(self._fd).st_blocks * 512  # the file's own, and free
        os.ftruncate(self._fd, size)  # sparse: the filesystem gives the blocks only as slots are written
        if room < size:
            logger.warning(
                "disk KV tier %s: --kv-offload-disk-size asks %.2f GiB but its filesystem has %.2f GiB free; once it "
                "is full the disk tier turns itself off (a failed write drops its block, never a request)",
                path,
                size / 2**30,
                room / 2**30,
            )
        logger.info("disk KV tier %s: %d slots, %d blocks kept from before", path, layout.num_slots, len(self.found))

    def _offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.layout.record_bytes

    def _scan(self) -> list[tuple[int, bytes]]:
        found, corrupt = [], 0
        for slot in range(self.layout.num_slots):
            record = os.pread(self._fd, self.layout.record_bytes, self._offset(slot))
            block_hash = record[:HASH_BYTES]
            if len(record) < self.layout.record_bytes or block_hash == bytes(HASH_BYTES):
                continue  # never written
            if _checksum(block_hash, record[HASH_BYTES + SUM_BYTES :]) == record[HASH_BYTES : HASH_BYTES + SUM_BYTES]:
                found.append((slot, block_hash))
            else:
                corrupt += 1
                os.pwrite(self._fd, bytes(HASH_BYTES + SUM_BYTES), self._offset(slot))  # forget it for good
        if corrupt:
            logger.warning("%s: %d blocks failed their checksum and will be recomputed", self.path, corrupt)
        return found

    def write(self, slot: int, block_hash: bytes, payload: bytes) -> None:
        """Store the block in `slot` (OSError when the disk refuses: full, failing)."""
        os.pwrite(self._fd, block_hash + _checksum(block_hash, payload) + payload, self._offset(slot))

    def invalidate(self, slot: int) -> None:
        """Best effort after a failed write: the slot's hash zeroed, so no later read can take a half-written
        record for a block (its checksum would catch most anyway)."""
        try:
            os.pwrite(self._fd, bytes(HASH_BYTES + SUM_BYTES), self._offset(slot))
        except OSError:
            pass  # never written (the file is sparse), or the disk refuses even this: reads fail their check

    def read(self, slot: int, block_hash: bytes) -> bytes:
        try:
            record = os.pread(self._fd, self.layout.record_bytes, self._offset(slot))
        except OSError as exc:
            raise DiskBlockUnreadable(f"disk KV tier slot {slot} could not be read: {exc}") from exc
        payload = record[HASH_BYTES + SUM_BYTES :]
        if (
            len(record) < self.layout.record_bytes
            or record[:HASH_BYTES] != block_hash
            or _checksum(block_hash, payload) != record[HASH_BYTES : HASH_BYTES + SUM_BYTES]
        ):
            raise DiskBlockUnreadable(f"disk KV tier slot {slot} does not hold an intact copy of the block asked for")
        return payload

    def close(self) -> None:
        os.close(self._fd)


def _block_bytes(cache: KVCache, index: int) -> bytes:
    parts = [t[index].reshape(-1).view(torch.uint8) for layer in cache for t in layer.tensors()]
    return torch.cat(parts).cpu().numpy().tobytes()


def _fill_blocks(cache: KVCache, indices: list[int], payloads: list[bytes]) -> None:
    """Each payload into its block: one batched copy per layer tensor for all of them (a copy per block and
    tensor cost more than reading the blocks)."""
    flat = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8).view(len(payloads), -1)
    ids = torch.tensor(indices, dtype=torch.int64, device=cache[0].k.device)
    offset = 0
    for layer in cache:
        for t in layer.tensors():
            n = t[0].numel() * t.element_size()
            part = flat[:, offset : offset + n].contiguous().view(t.dtype).view(len(indices), *t.shape[1:])
            t[ids] = part.to(t.device)
            offset += n


@dataclass(slots=True)
class TierRun:
    """What running a plan's tier moves did: the milliseconds taken (of which loading blocks back into the device
    cache), the loads that failed (their device blocks hold no valid KV) and the disk writes that failed (their
    blocks are not on disk)."""

    ms: float = 0.0
    load_ms: float = 0.0
    failed: list[TierMove] = field(default_factory=list)
    failed_stores: list[TierMove] = field(default_factory=list)


class KVOffload:
    """This rank's RAM tier (same layout as the device cache, pinned on a GPU host) and disk tier."""

    def __init__(self, ram: KVCache, disk: DiskTier | None) -> None:
        self.ram = ram
        self.disk = disk
        self.num_ram_slots = ram[0].num_blocks if ram else 0
        self.num_disk_slots = disk.layout.num_slots if disk is not None else 0

    def report(self, ready: WorkerReady) -> WorkerReady:
        """The Ready message with this rank's tier sizes and the disk blocks it found intact."""
        ready.num_ram_tier_blocks, ready.num_disk_tier_blocks = self.num_ram_slots, self.num_disk_slots
        ready.disk_tier_blocks = list(self.disk.found) if self.disk is not None else []
        return ready

    def check(self, moves: list[TierMove], num_device_blocks: int) -> None:
        """Every slot and block id in range, every disk move keyed by a hash of the right size (ValueError)."""
        limits = {DEVICE: num_device_blocks, RAM: self.num_ram_slots, DISK: self.num_disk_slots}
        names = {DEVICE: "block id", RAM: "RAM tier slot", DISK: "disk tier slot"}
        for m in moves:
            for tier, index in ((m.src_tier, m.src), (m.dst_tier, m.dst)):
                if not 0 <= index < limits[tier]:
                    raise ValueError(f"{names[tier]} {index} is outside [0, {limits[tier]})")
            if DISK in (m.src_tier, m.dst_tier) and len(m.block_hash) != HASH_BYTES:
                raise ValueError(f"a disk tier move needs a {HASH_BYTES}-byte block hash")

    def run(self, moves: list[TierMove], device: KVCache) -> TierRun:
        """Run the moves in order (runs between the same two tiers batched). A disk block that fails its check is
        skipped and reported, the rest still run."""
        out = TierRun()
        if not moves:
            return out
        start = time.perf_counter()
        i = 0
        while i < len(moves):
            j = i
            while j < len(moves) and (moves[j].src_tier, moves[j].dst_tier) == (moves[i].src_tier, moves[i].dst_tier):
                j += 1
            run_start = time.perf_counter()
            failed = self._run_between(moves[i:j], device)
            if moves[i].dst_tier == DISK:
                out.failed_stores += failed
            else:
                out.failed += failed
            if moves[i].dst_tier == DEVICE:
                out.load_ms += (time.perf_counter() - run_start) * 1e3
            i = j
        if device and device[0].k.is_cuda:
            torch.cuda.synchronize(device[0].k.device)
        out.ms = (time.perf_counter() - start) * 1e3
        return out

    def _run_between(self, run: list[TierMove], device: KVCache) -> list[TierMove]:
        """Moves that all go between the same two tiers; returns the disk moves that failed (loads that failed
        their check, writes the disk refused)."""
        caches = {DEVICE: device, RAM: self.ram}
        src, dst = run[0].src_tier, run[0].dst_tier
        if DISK not in (src, dst):
            copy_blocks(caches[src], caches[dst], [(m.src, m.dst) for m in run])
            return []
        assert self.disk is not None
        if dst == DISK:
            return self._write_disk(run, caches[src])
        failed, filled, payloads = [], [], []
        for m in run:
            try:
                payloads.append(self.disk.read(m.src, m.block_hash))
                filled.append(m.dst)
            except DiskBlockUnreadable as exc:
                logger.warning("%s: the block is recomputed instead", exc)
                failed.append(m)
        if filled:
            _fill_blocks(caches[dst], filled, payloads)
        return failed

    def _write_disk(self, run: list[TierMove], src: KVCache) -> list[TierMove]:
        """Write each block to its disk slot; the writes the disk refuses are dropped and returned (a full disk
        must cost the cache, never a step)."""
        assert self.disk is not None
        failed, error = [], None
        for m in run:
            try:
                self.disk.write(m.dst, m.block_hash, _block_bytes(src, m.src))
            except OSError as exc:
                failed.append(m)
                error = exc
                self.disk.invalidate(m.dst)
        if failed:
            logger.warning("disk KV tier %s: %d block(s) not written (%s); dropped", self.disk.path, len(failed), error)
        return failed

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
