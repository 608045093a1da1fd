"""The worker's slice of the paged KV cache, sized from the memory it may use."""

from __future__ import annotations

import logging

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


def kv_cache_budget(device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float) -> int:
    """An explicit byte count wins; else a fraction of free memory (GPU) or a quarter of free RAM (CPU)."""
    if kv_cache_memory:
        return kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - gpu_memory_utilization) * total))
    return available_memory(device) // 4


def allocate_kv_cache(
    config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, budget: int
) -> KVCache:
    num_blocks = budget // bytes_per_block(config, block_size, dtype)
    if num_blocks < 1:
        raise MemoryError(f"{budget} bytes of KV memory hold no block; raise --kv-cache-memory")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    cache = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, block_size, budget / 2**30)
    return cache
