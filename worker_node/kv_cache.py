"""The worker's slice of the paged KV cache, sized from the memory it may use."""

from __future__ import annotations

import logging
import time

import torch

from worker_node.models.config import ModelConfig

logger = logging.getLogger(__name__)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v), each [N, block_size, Hkv, D]


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


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


def allocate_kv_cache(
    config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> KVCache:
    if num_blocks < 1:
        raise MemoryError("the KV memory holds no block; raise --kv-cache-memory")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    cache = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]
    size = num_blocks * bytes_per_block(config, block_size, dtype)
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, block_size, size / 2**30)
    return cache


def allocate_host_cache(
    config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> KVCache:
    """Swap space in host memory, same layout as the device cache (pinned when the device is a GPU)."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    pin = device.type == "cuda"
    return [
        (torch.empty(shape, dtype=dtype, pin_memory=pin), torch.empty(shape, dtype=dtype, pin_memory=pin))
        for _ in range(config.num_layers)
    ]


def copy_blocks(src_cache: KVCache, dst_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy block pairs[i][0] of src_cache into block pairs[i][1] of dst_cache, in order."""
    if not pairs:
        return
    src = [p[0] for p in pairs]
    dst = [p[1] for p in pairs]
    if src_cache is dst_cache and set(src) & set(dst):  # a chain (a block copied, then its copy copied): in order
        for (sk, sv), (dk, dv) in zip(src_cache, dst_cache):
            for s, d in pairs:
                dk[d].copy_(sk[s])
                dv[d].copy_(sv[s])
        return
    device = dst_cache[0][0].device
    src_i = torch.tensor(src, device=src_cache[0][0].device)
    dst_i = torch.tensor(dst, device=device)
    for (sk, sv), (dk, dv) in zip(src_cache, dst_cache):
        dk.index_copy_(0, dst_i, sk.index_select(0, src_i).to(device, non_blocking=True))
        dv.index_copy_(0, dst_i, sv.index_select(0, src_i).to(device, non_blocking=True))


def measure_swap_bandwidth(device_cache: KVCache, host_cache: KVCache, block_bytes: int) -> float:
    """Bytes per second of a device → host → device round trip of a few blocks (0 without swap space)."""
    n = min(16, host_cache[0][0].shape[0], device_cache[0][0].shape[0]) if host_cache else 0
    if n == 0:
        return 0.0
    pairs = [(i, i) for i in range(n)]
    copy_blocks(device_cache, host_cache, pairs)  # warm-up
    sync = torch.cuda.synchronize if device_cache[0][0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    copy_blocks(device_cache, host_cache, pairs)
    copy_blocks(host_cache, device_cache, pairs)
    sync()
    return 2 * n * block_bytes / max(time.perf_counter() - start, 1e-9)
