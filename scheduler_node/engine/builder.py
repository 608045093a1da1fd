"""Assembling an engine core: the world's assignments, the scheduler sized to the world, the engine on top.

The same steps for every door: vllm-scheduler (workers over ZeroMQ) and the offline `LLM` (in-process, or worker
processes for TP/PP worlds), from the same settings (settings/engine.py's EngineConfig). The transport assembles the
world; `make_engine` sizes the scheduler from what it holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from proto.lora import BaseShapes
from proto.multimodal import resolve_extra_modules, text_config
from proto.parallel import ParallelLayout
from proto.quantization import resolve_quantization
from proto.transport import WorkerTransport, WorldCapacity
from proto.wire import Assignment
from scheduler_node.core.kv.tier_index import KVTiers
from scheduler_node.core.policy import Policy, make_policy
from scheduler_node.core.scheduler import PreemptionCosts, Scheduler
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.lora_registry import LoraRegistry
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.placement import Placement, RankAssigner
from scheduler_node.engine.ports import free_port
from scheduler_node.text.images import ImagePrompts
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.engine import EngineConfig
from settings.lora import LoraConfig
from settings.scheduler import BLOCK_SIZES, SchedulerConfig
from settings.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class WorldPlan:
    """What each rank of the world is told when it joins, and which joining worker becomes which rank (the
    transport adds the world's KV size when a lost rank is replaced)."""

    def __init__(self, config: EngineConfig, folder: Path, placement: Placement, distributed_port: int = 0) -> None:
        self.config = config
        self.folder = folder
        self.layout = placement.layout
        self.assigner = RankAssigner(placement)
        port = distributed_port or free_port("")
        self.rendezvous = f"{self.assigner.rendezvous_host}:{port}" if self.layout.world_size > 1 else ""
        self.claim = self.assigner.claim

    def assignment(self, rank: int) -> Assignment:
        c, s, layout = self.config, self.config.scheduler, self.layout
        draft, k, draft_seqs = draft_assignment(s)
        return Assignment(
            rank,
            layout.world_size,
            str(self.folder),
            c.dtype,
            s.block_size,
            s.max_num_batched_tokens,
            s.max_num_seqs,
            layout.tensor_parallel_size,
            layout.pipeline_parallel_size,
            self.rendezvous,
            self.assigner.devices.get(rank, ""),
            c.distributed_timeout,
            c.mode,
            c.num_kv_blocks,
            c.num_swap_blocks,
            kv_compact_fraction=c.kv_compact.fraction,
            kv_compact_dtype=c.kv_compact.dtype,
            quantization=c.quantization,
            extra_modules=list(c.multimodal.extra_modules),
            draft_model=draft,
            num_speculative_tokens=k,
            draft_max_seqs=draft_seqs,
            max_loras=s.max_loras if c.lora.enable_lora else 0,
            max_lora_rank=c.lora.max_lora_rank if c.lora.enable_lora else 0,
        )


def draft_assignment(s: SchedulerConfig) -> tuple[str, int, int]:
    """The Assignment's draft model fields: the draft's folder ("" for none), its k, and the requests its KV cache
    holds (those that speculate at once, at most)."""
    spec = s.speculative
    if spec is None or spec.method != "draft_model":
        return "", 0, 0
    folder = Path(spec.model)
    model = str(folder.resolve()) if folder.is_dir() else spec.model  # the workers may run in another directory
    return model, spec.num_speculative_tokens, min(s.max_num_seqs, spec.disable_by_batch_size)


def check_speculative(folder: Path, spec: SpeculativeConfig | None) -> None:
    """ValueError, before any worker loads, when speculative decoding cannot run as configured: with a draft
    model whose vocabulary or tokenizer is not the target's (its tokens would mean other words)."""
    if spec is None:
        return
    if spec.method != "draft_model":
        return
    draft = Path(spec.model)
    if not (draft / "config.json").is_file():
        raise ValueError(f"speculative_config.model: {draft} is not a model folder (no config.json)")
    vocab = [json.loads((f / "config.json").read_text()).get("vocab_size") for f in (folder, draft)]
    if vocab[0] != vocab[1]:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({vocab[1]} tokens) is not the target's ({vocab[0]})"
        )
    if _tokenizer_vocab(folder) != _tokenizer_vocab(draft):
        raise ValueError(f"speculative_config.model: {draft} has another tokenizer than the target's")


def _tokenizer_vocab(folder: Path) -> object:
    """A tokenizer.json's tokens and their ids (its model's vocabulary and added tokens); None without one."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    t = json.loads(path.read_text())
    added = sorted((a["id"], a["content"]) for a in t.get("added_tokens", []))
    return t.get("model", {}).get("vocab"), added


def make_engine(
    config: EngineConfig,
    folder: Path,
    tokenizer: ModelTokenizer,
    workers: WorkerTransport,
    capacity: WorldCapacity,
    metrics: Metrics | None = None,
    policy: Policy | None = None,
) -> EngineCore:
    """The scheduler sized to the assembled world, and the engine core over it; `policy`: an instance to order
    requests with (`LLM(scheduler=...)`), else the one `config.scheduling_policy` names."""
    s = config.scheduler
    max_len = resolve_max_model_len(s.max_model_len, model_limit(folder), capacity.num_kv_blocks, s.block_size)
    if policy is None:
        policy = make_policy(config.scheduling_policy, config.aging_interval, config.displacement_margin)
    costs = PreemptionCosts(bytes_per_block=capacity.bytes_per_block, swap_bytes_per_s=capacity.swap_bytes_per_s)
    tiers = KVTiers(capacity.ram_tier_blocks, capacity.disk_tier_blocks, s.kv_offload_policy, capacity.bytes_per_block)
    tiers.adopt_disk(capacity.disk_tier_entries)
    scheduler = Scheduler(
        dataclasses.replace(s, max_model_len=max_len),
        capacity.num_kv_blocks,
        policy,
        config.mode,
        capacity.num_swap_blocks,
        costs,
        tiers=tiers,
        num_compact_blocks=capacity.num_compact_blocks,
        precision=config.kv_compact,
    )
    engine = EngineCore(scheduler, tokenizer, workers, config.options, metrics or Metrics(folder.name))
    engine.loras = lora_registry(config.lora, folder)
    mm = config.multimodal
    engine.images = ImagePrompts.build(
        folder, mm.extra_modules, mm.images_per_prompt, mm.max_image_pixels, mm.allowed_local_media_path
    )
    return engine


def lora_registry(config: LoraConfig, folder: Path) -> LoraRegistry | None:
    """The adapters of --lora-modules, checked against the model (None without --enable-lora)."""
    if not config.enable_lora:
        return None
    registry = LoraRegistry(BaseShapes.from_folder(folder), config.max_lora_rank)
    for name, path in config.modules:
        registry.add(name, path)
    return registry


def check_model_split(
    folder: Path,
    layout: ParallelLayout,
    quantization: str = "auto",
    speculative: SpeculativeConfig | None = None,
    extra_modules: tuple[str, ...] = (),
) -> None:
    """ValueError when the model's heads, MLP or layers do not split over this layout, or its checkpoint cannot
    run in the `quantization` asked for, or speculative decoding as configured (before any worker loads it)."""
    resolve_quantization(quantization, folder)
    check_speculative(folder, speculative)
    resolve_extra_modules(extra_modules, folder)
    c = text_config(json.loads((folder / "config.json").read_text()))
    heads = int(c["num_attention_heads"])
    layout.check_model(
        heads, int(c.get("num_key_value_heads") or heads), int(c["intermediate_size"]), int(c["num_hidden_layers"])
    )


def with_block_bytes(config: EngineConfig, folder: Path) -> EngineConfig:
    """`config` with --kv-block-bytes (article 000's `block_size: 16KB`) made a --block-size for this model: the
    largest supported block whose tokens' keys and values in one layer (every KV head, at the model's dtype: --dtype,
    else the checkpoint's torch_dtype) fit in those bytes, logged. ValueError naming block_size when not even the
    smallest block fits. Unchanged without --kv-block-bytes."""
    s = config.scheduler
    if not s.kv_block_bytes:
        return config
    per_token = kv_bytes_per_token_per_layer(folder, config.dtype)
    fits = [size for size in BLOCK_SIZES if size * per_token <= s.kv_block_bytes]
    if not fits:
        raise ValueError(
            f"block_size {s.kv_block_bytes} bytes holds {s.kv_block_bytes / per_token:.1f} tokens of this model's KV "
            f"({per_token} bytes per token per layer); the smallest block is {BLOCK_SIZES[0]} tokens "
            f"({BLOCK_SIZES[0] * per_token} bytes)"
        )
    tokens = fits[-1]
    logger.info(
        "block_size %d bytes is %.1f tokens of this model's KV (%d bytes per token per layer): blocks of %d tokens",
        s.kv_block_bytes,
        s.kv_block_bytes / per_token,
        per_token,
        tokens,
    )
    return dataclasses.replace(config, scheduler=dataclasses.replace(s, block_size=tokens))


def kv_bytes_per_token_per_layer(folder: Path, dtype: str) -> int:
    """Bytes of one token's keys and values in one layer, every KV head, at `dtype` (auto: the checkpoint's)."""
    c = json.loads((folder / "config.json").read_text())
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    name = dtype if dtype != "auto" else str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    return 2 * kv_heads * head_dim * DTYPE_BYTES.get(name, 2)


def resolve_max_model_len(requested: int, model_limit: int, num_blocks: int, block_size: int) -> int:
    capacity = num_blocks * block_size
    if requested > capacity:
        raise ValueError(
            f"--max-model-len {requested} needs more KV than the workers have ({capacity} tokens); "
            "give the workers more --kv-cache-memory or lower --max-model-len"
        )
    if requested:
        return min(requested, model_limit)
    if capacity < model_limit:
        logger.warning("max_model_len capped at the KV capacity: %d tokens (model allows %d)", capacity, model_limit)
    return min(model_limit, capacity)


def model_limit(folder: Path) -> int:
    c = text_config(json.loads((folder / "config.json").read_text()))
    return int(c.get("max_position_embeddings", 4096))
