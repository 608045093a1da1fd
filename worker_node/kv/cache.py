"""The worker's slice of the paged KV cache, sized from the memory it may use.

Each layer's cache is a `LayerKV`: keys and values `[N, block_size, Hkv, D]` in the model's dtype, or quantized
(int8 / fp8 e4m3, `--kv-cache-dtype`) with float32 scales `[N, block_size, Hkv]` beside them
(kernels/kv_quant.py). Every block-wise move (swap, copy-on-write) moves the scales with the values.

With per-request KV precision (scheduler_node/core/kv/precision.py) a layer also holds a compact pool
(`LayerKV.compact`, quantized): the plan's block ids from `compact_block_base` on address it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels.kv_quant import SCALE_BYTES, SCALE_DTYPE, as_bytes, is_quantized

logger = logging.getLogger(__name__)


class KVShape(Protocol):
    """What sizing a cache needs of a model: its layers (of this rank's stage) and each token's KV heads. A model's
    config (worker_node/models/config.py) is one; the cache does not import the models that import it."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's paged cache: keys and values, and a quantized cache's scales (None at full precision)."""

    k: torch.Tensor  # [N, block_size, Hkv, D]
    v: torch.Tensor
    k_scales: torch.Tensor | None = None  # [N, block_size, Hkv] float32
    v_scales: torch.Tensor | None = None
    compact: LayerKV | None = None  # the same layer's compact pool (per-request KV precision); None without one

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block first: what a block copy moves."""
        return [t for t in (self.k, self.v, self.k_scales, self.v_scales) if t is not None]

    def scale_options(self) -> dict[str, Any]:
        """The attention backend's keyword arguments for this cache: its scales, when it is quantized."""
        if self.k_scales is None:
            return {}
        return {"k_scales": self.k_scales, "v_scales": self.v_scales}


KVCache = list[LayerKV]  # per layer of this rank's stage


def bytes_per_block(config: KVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over every layer: keys and values in `dtype`, plus their scales when it is quantized."""
    elem = torch.tensor([], dtype=dtype).element_size()
    row = config.head_dim * elem + (SCALE_BYTES if is_quantized(dtype) else 0)  # one token's head, K or V
    return 2 * config.num_layers * block_size * config.num_kv_heads * row


def available_memory(device: torch.device) -> int:
    """Bytes this process could still allocate on the device."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_cache_budget(
    device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float, ranks_on_host: int = 1
) -> int:
    """An explicit byte count wins; else a fraction of free memory (GPU), or a quarter of free RAM (CPU) shared
    by the `ranks_on_host` ranks of the world that size themselves from the same RAM at the same moment."""
    if kv_cache_memory:
        return kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - gpu_memory_utilization) * total))
    return available_memory(device) // 4 // max(1, ranks_on_host)


def kv_cache_limit(device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float) -> int:
    """The most KV memory a worker may take when the scheduler tells it the world's size: an explicit byte count,
    else what the device can give (the GPU's share, or nine tenths of free RAM)."""
    if kv_cache_memory or device.type == "cuda":
        return kv_cache_budget(device, kv_cache_memory, gpu_memory_utilization)
    return available_memory(device) * 9 // 10


def _layer(
    config: KVShape, block_size: int, dtype: torch.dtype, num_blocks: int, make: Any, **placement: Any
) -> LayerKV:
    """One layer's cache, its tensors made by `make` (torch.zeros or torch.empty) with `placement` (torch's
    device / pin_memory arguments)."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    k, v = (make(shape, dtype=dtype, **placement) for _ in range(2))
    if not is_quantized(dtype):
        return LayerKV(k, v)
    k_scales, v_scales = (make(shape[:3], dtype=SCALE_DTYPE, **placement) for _ in range(2))
    return LayerKV(k, v, k_scales, v_scales)


def allocate_kv_cache(
    config: KVShape, block_size: int, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> KVCache:
    if num_blocks < 1:
        raise MemoryError("the KV memory holds no block; raise --kv-cache-memory")
    cache = [
        _layer(config, block_size, dtype, num_blocks, torch.zeros, device=device) for _ in range(config.num_layers)
    ]
    size = num_blocks * bytes_per_block(config, block_size, dtype)
    logger.info("KV cache: %d blocks of %d tokens, %s (%.2f GiB)", num_blocks, block_size, dtype, size / 2**30)
    return cache


def attach_compact(cache: KVCache, compact: KVCache) -> KVCache:
    """Each layer of `cache` with the same layer of the compact pool beside it."""
    return [dataclasses.replace(layer, compact=c) for layer, c in zip(cache, compact, strict=True)]


def allocate_host_cache(
    config: KVShape, block_size: int, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> KVCache:
    """Swap space in host memory, same layout as the device cache (pinned when the device is a GPU)."""
    pin = device.type == "cuda"
    return [
        _layer(config, block_size, dtype, num_blocks, torch.empty, pin_memory=pin) for _ in range(config.num_layers)
    ]


def copy_blocks(src_cache: KVCache, dst_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy block pairs[i][0] of src_cache into block pairs[i][1] of dst_cache, in order."""
    if not pairs:
        return
    src = [p[0] for p in pairs]
    dst = [p[1] for p in pairs]
    if src_cache is dst_cache and set(src) & set(dst):  # a chain (a block copied, then its copy copied): in order
        for layer in src_cache:
            for t in layer.tensors():
                for s, d in pairs:
                    t[d].copy_(t[s])
        return
    device = dst_cache[0].k.device
    src_i = torch.tensor(src, device=src_cache[0].k.device)
    dst_i = torch.tensor(dst, device=device)
    for src_layer, dst_layer in zip(src_cache, dst_cache):
        for s_t, d_t in zip(src_layer.tensors(), dst_layer.tensors(), strict=True):
            moved = as_bytes(s_t).index_select(0, src_i).to(device, non_blocking=True)
            as_bytes(d_t).index_copy_(0, dst_i, moved)


def measure_swap_bandwidth(device_cache: KVCache, host_cache: KVCache, block_bytes: int) -> float:
    """Bytes per second of a device → host → device round trip of a few blocks (0 without swap space)."""
    n = min(16, host_cache[0].num_blocks, device_cache[0].num_blocks) if host_cache else 0
    if n == 0:
        return 0.0
    pairs = [(i, i) for i in range(n)]
    copy_blocks(device_cache, host_cache, pairs)  # warm-up
    sync = torch.cuda.synchronize if device_cache[0].k.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    copy_blocks(device_cache, host_cache, pairs)
    copy_blocks(host_cache, device_cache, pairs)
    sync()
    return 2 * n * block_bytes / max(time.perf_counter() - start, 1e-9)
