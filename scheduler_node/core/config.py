"""Scheduler configuration: one frozen dataclass that checks itself."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from scheduler_node.core.speculative import SpeculativeConfig
from scheduler_node.core.tier_policy import KV_OFFLOAD_POLICIES


class PreemptionMode(str, enum.Enum):
    """What happens to a request preempted when KV blocks run out."""

    RECOMPUTE = "recompute"  # drop its blocks; its tokens are computed again when it resumes
    SWAP = "swap"  # move its blocks to the workers' host memory and back when it resumes
    ELASTIC = "elastic"  # per victim, whichever of the two is cheaper by measured compute time and swap bandwidth


PREEMPTION_MODES = tuple(m.value for m in PreemptionMode)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int = 16  # tokens per KV block
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 128  # running requests at once
    max_model_len: int = 0  # 0: from the model's config (and the KV capacity)
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.ELASTIC
    compaction_interval: int = 0  # steps between compactions of live blocks (0: never)
    compaction_max_moves: int = 64  # blocks moved per compaction at most
    watermark: float = 0.01  # fraction of blocks kept free when admitting, against admit-then-preempt thrash
    kv_offload_policy: str = "arc"  # replacement in the KV offload tiers (scheduler_node/core/kv_tiers.py)
    max_loras: int = 1  # LoRA adapters resident on the workers at once (scheduler_node/core/lora_slots.py)
    max_cpu_loras: int = 0  # LoRA adapters evicted from a slot that the workers keep in host memory (0: none)
    speculative: SpeculativeConfig | None = None  # speculative decoding (core/speculative.py); None: off

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_offload_policy not in KV_OFFLOAD_POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {KV_OFFLOAD_POLICIES}, got {self.kv_offload_policy!r}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 0 <= self.max_cpu_loras <= 4096:
            raise ValueError(f"max_cpu_loras must be in [0, 4096], got {self.max_cpu_loras}")
        if self.compaction_interval < 0 or self.compaction_max_moves < 1:
            raise ValueError("compaction_interval must be >= 0 and compaction_max_moves >= 1")
