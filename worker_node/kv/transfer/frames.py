"""The bytes of KV blocks, without a socket: what `KVLayout` a rank's cache has, and a run of its blocks (of a run of
its KV heads) as frames, one per (layer, tensor) in cache order (keys, values and an int8/fp8 cache's scales).
`export_frames` makes new host arrays (the TCP path's frames), `export_into` writes them into a flat uint8 buffer at
aligned offsets (a same-host staging buffer, staging.py), and `import_frames` writes either kind into
other blocks. exporter.py moves them between worlds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.kv_quant import format_name
from proto.kv_transfer import HeadRun, KVLayout, KVTransferError
from worker_node.kv.cache import KVCache
from worker_node.kv.transfer.staging import aligned


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


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view as the widest integer type its layout allows: index_copy_ moves elements, and on a CPU it is
    ~20x faster moving 8-byte ones than bytes."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if t.shape[-1] % size == 0 and t.storage_offset() % size == 0 and all(s % size == 0 for s in t.stride()[:-1]):
            return t.view(dtype)
    return t


def export_frames(cache: KVCache, blocks: Sequence[int], heads: HeadRun | None = None) -> list[np.ndarray]:
    """The blocks' bytes (of a run of this rank's KV heads), one contiguous `[len(blocks), bytes]` array per layer
    and tensor, in cache order."""
    index = torch.tensor(list(blocks), dtype=torch.long, device=cache[0].k.device)
    return [
        _byte_rows(_head_slice(t, heads).index_select(0, index).contiguous()).cpu().numpy()
        for layer in cache
        for t in layer.tensors()
    ]


def export_into(
    cache: KVCache, blocks: Sequence[int], buffer: torch.Tensor, heads: HeadRun | None = None
) -> list[tuple[int, int]]:
    """`export_frames` into a flat uint8 `buffer` (a staging buffer on the cache's device) instead of new arrays:
    each frame at an `ALIGN`ed offset; returns each frame's (offset, bytes). `frame_sizes` says how much room."""
    index = torch.tensor(list(blocks), dtype=torch.long, device=cache[0].k.device)
    places, offset = [], 0
    for layer in cache:
        for t in layer.tensors():
            part = _head_slice(t, heads).view(torch.uint8)  # heads narrow dim 2: the last stays contiguous
            size = len(blocks) * part[:1].numel()
            out = buffer[offset : offset + size].view(len(blocks), *part.shape[1:])
            torch.index_select(_wide(part), 0, index, out=_wide(out))
            places.append((offset, size))
            offset = aligned(offset + size)
    return places


def staging_bytes(cache: KVCache, blocks: int, heads: HeadRun | None = None) -> int:
    """Bytes of a staging buffer for `blocks` blocks (of a run of heads): the frames at aligned offsets."""
    per_block = (_head_slice(t, heads)[:1].numel() * t.element_size() for layer in cache for t in layer.tensors())
    return sum(aligned(blocks * b) for b in per_block)


def import_frames(
    cache: KVCache,
    blocks: Sequence[int],
    frames: Sequence[memoryview | bytes | np.ndarray | torch.Tensor],
    heads: HeadRun | None = None,
) -> None:
    """Write frames (as `export_frames` makes them, for as many blocks) into these blocks of `cache` (into a run of
    its KV heads)."""
    tensors = [t for layer in cache for t in layer.tensors()]
    if len(frames) != len(tensors):
        raise KVTransferError(f"{len(frames)} frames for a cache of {len(tensors)} tensors")
    index = torch.tensor(list(blocks), dtype=torch.long, device=cache[0].k.device)
    for t, frame in zip(tensors, frames, strict=True):
        if isinstance(frame, torch.Tensor):  # a flat uint8 slice of a mapped staging buffer (maybe on a GPU)
            data = frame
        else:
            data = torch.frombuffer(bytearray(frame) if isinstance(frame, bytes) else frame, dtype=torch.uint8)
        part = _head_slice(t, heads).view(torch.uint8)  # heads narrow dim 2: the last stays contiguous
        if data.numel() != len(blocks) * part[:1].numel():
            of = f"heads {heads}" if heads is not None else str(part[:1].numel())
            raise KVTransferError(f"a frame of {data.numel()} bytes for {len(blocks)} blocks of {of}")
        _wide(part).index_copy_(0, index, _wide(data.view(len(blocks), *part.shape[1:]).to(part.device)))
