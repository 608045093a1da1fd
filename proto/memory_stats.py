"""KV memory in bytes, per tier and format: what Control.GetStats (`Stats.memory`), `vllm-client stats` and the
metrics endpoint report. A pool is one format on one tier; the device tier and the swap space are reported
the offload tiers (host RAM, disk) when they are on."""

from __future__ import annotations

from dataclasses import dataclass

DEVICE = "device"  # the workers' KV cache
SWAP = "swap"  # host memory holding the blocks of swapped-out requests
RAM = "ram"  # the KV offload tier in host RAM (prefix blocks evicted from the device)
DISK = "disk"  # the KV offload tier on disk


@dataclass(frozen=True, slots=True)
class KvPool:
    """One pool of KV blocks, its bytes summed over every rank of the world."""

    tier: str
    format: str  # the stored KV: float32, bfloat16, float16, int8, fp8_e4m3
    bytes_per_block: int  # values and, when quantized, their scales
    total_blocks: int
    used_blocks: int
    hits: int = 0  # prompt tokens found in this tier's prefix cache

    @property
    def allocated_bytes(self) -> int:
        return self.total_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block
