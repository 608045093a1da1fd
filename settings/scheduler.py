"""The scheduler's settings: the step's budgets, the KV blocks' use and reuse, preemption, LoRA slots and
speculation (scheduler_node/core/)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from settings.setting import check, setting
from settings.speculative import DISABLE_BY_BATCH_SIZE, SpeculativeConfig, speculative_text
from settings.units import has_byte_unit, parse_size


class PreemptionMode(str, enum.Enum):
    """What happens to a request preempted when KV blocks run out."""

    RECOMPUTE = "recompute"  # drop its blocks; its tokens are computed again when it resumes
    SWAP = "swap"  # move its blocks to the workers' host memory and back when it resumes
    ELASTIC = "elastic"  # per victim, whichever of the two is cheaper by measured compute time and swap bandwidth


PREEMPTION_MODES = tuple(m.value for m in PreemptionMode)
KV_OFFLOAD_POLICIES = ("arc", "lru")  # scheduler_node/core/kv/tier_policy.py
BLOCK_SIZES = (8, 16, 32, 64, 128)
BOTH = ("scheduler", "worker")  # the scheduler's, handed to every worker in its Assignment


def block_tokens(text: str) -> int:
    """--block-size's value: tokens. A byte size is refused here, naming the setting that takes it (a config file's
    `block_size: 16KB` is turned into `kv_block_bytes` by settings/config_file.py)."""
    if has_byte_unit(text):
        raise ValueError(f"block_size {text} is a size in bytes: give it as --kv-block-bytes {text}")
    return int(text)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler: budgets of a step, KV blocks, preemption, LoRA slots, speculation."""

    block_size: int = setting(
        16,
        choices=BLOCK_SIZES,
        parse=block_tokens,
        readers=BOTH,
        help="tokens per KV block (8, 16, 32, 64, 128); a size in bytes (block_size: 16KB in a config file, as "
        "article 000 writes it) is --kv-block-bytes",
    )
    kv_block_bytes: int = setting(
        0,
        low=0,
        parse=parse_size,
        readers="scheduler",
        help="a KV block's size in bytes (16KB; 0: off), converted to tokens once the model is known: the keys and "
        "values of one token in one layer, every KV head, at the model's dtype (--dtype, else the checkpoint's), "
        "rounded down to a supported --block-size (logged; one that holds fewer than 8 tokens is an error). Wins "
        "over --block-size",
    )
    max_num_batched_tokens: int = setting(
        2048, low=1, readers=BOTH, help="token budget of one step; prompts longer than this are prefilled in chunks"
    )
    max_num_seqs: int = setting(
        128, low=1, aliases=("max_batch_size",), readers=BOTH, help="running requests at most (a batch's rows)"
    )
    max_model_len: int = setting(
        0, low=0, readers="scheduler", help="context length (0: the model's, capped by the KV cache capacity)"
    )
    enable_prefix_caching: bool = setting(
        True,
        readers="scheduler",
        help="reuse the KV of identical prompt prefixes across requests (--no-enable-prefix-caching: off)",
    )
    preemption_mode: PreemptionMode = setting(
        PreemptionMode.ELASTIC,
        choices=PREEMPTION_MODES,
        readers="scheduler",
        help="when KV runs out: recompute the victim later, swap its blocks to host memory, or elastic "
        "(per victim, whichever is cheaper by measured compute time and swap bandwidth)",
    )
    compaction_interval: int = setting(
        0,
        low=0,
        readers="scheduler",
        help="every N steps, move live KV blocks into the lowest free ones (0: never). Compaction and "
        "Control.ResizeCache only limit which blocks the scheduler hands out: the workers' KV tensors keep their "
        "size, so a shrink gives no device memory back (docs/guide.md, KV memory)",
    )
    compaction_max_moves: int = setting(64, low=1, readers="scheduler", help="blocks one compaction moves at most")
    watermark: float = setting(
        0.01,
        low=0,
        below=1,
        readers="scheduler",
        help="fraction of KV blocks kept free when admitting requests (avoids admit-then-preempt thrash)",
    )
    kv_offload_policy: str = setting(
        "arc",
        choices=KV_OFFLOAD_POLICIES,
        readers="scheduler",
        help="replacement in the workers' KV offload tiers (--kv-offload-ram, --kv-offload-disk): arc (adaptive: "
        "recency and frequency, scan-resistant) or lru",
    )
    max_loras: int = setting(
        1,
        low=1,
        readers=BOTH,
        help="adapters resident on the workers at once; a request whose adapter finds every slot in use waits "
        "while others run, and the least recently used idle adapter is evicted",
    )
    max_cpu_loras: int = setting(
        0,
        low=0,
        high=4096,
        readers="scheduler",
        help="adapters evicted from the workers' slots that they keep in host memory (least recently evicted out "
        "first), so a reload skips the disk; 0: none",
    )
    speculative: SpeculativeConfig | None = setting(
        None,
        name="speculative_config",
        parse=speculative_text,
        readers=BOTH,
        help='speculative decoding, as vLLM spells it: a JSON object such as \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\' or \'{"method": '
        '"draft_model", "model": PATH, "num_speculative_tokens": 4}\' (also "disable_by_batch_size": no '
        f"speculation while more requests run; default {DISABLE_BY_BATCH_SIZE}). Empty: off",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        check(self)
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
