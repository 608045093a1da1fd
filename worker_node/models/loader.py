"""Load an HF safetensors folder into our Llama-family model, fusing q/k/v and gate/up as we go.

With tensor or pipeline parallelism each worker reads only the tensors of its stage and keeps only its slice
of each: its heads of q/k/v and o, its part of gate/up and down, its vocab rows.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kernels.backend import AttentionBackend
from proto.parallel import kv_head_range, shard, vocab_shard
from worker_node.models.config import ModelConfig
from worker_node.models.llama import LlamaForCausalLM
from worker_node.parallel import SINGLE, Comm, ParallelRank

logger = logging.getLogger(__name__)

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class Checkpoint:
    """The tensors of a safetensors folder, read one at a time on demand (a pipeline stage reads its own)."""

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                self._where[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()


def load_model(
    folder: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    where: ParallelRank = SINGLE,
    comm: Comm | None = None,
) -> LlamaForCausalLM:
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    where.layout.check_model(config.num_heads, config.num_kv_heads, config.intermediate_size, config.num_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions, where, comm)
    hf = Checkpoint(folder)
    try:
        state = {name: _hf_tensor(hf, name, config, where, model.first_layer) for name in model.state_dict()}
    finally:
        hf.close()
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings and model.lm_head is not None and model.embed_tokens is not None:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = model.rotary.__class__(config, max_positions)  # buffers were created on meta
    model.to(device=device, dtype=dtype)
    model.rotary.to(dtype=torch.float32)
    model.eval()
    logger.info(
        "loaded %s (%s, %d of %d layers, TP rank %d of %d) in %s",
        folder.name,
        config.model_type,
        len(model.layers),
        config.num_layers,
        where.tp_rank,
        where.tp_size,
        dtype,
    )
    return model


def _hf_tensor(
    hf: Checkpoint, name: str, config: ModelConfig, where: ParallelRank, first_layer: int = 0
) -> torch.Tensor:
    """The checkpoint tensor behind one of our parameter names, cut to this TP rank's slice."""
    if name.startswith("layers."):  # a stage's local layer index -> the checkpoint's
        _, index, rest = name.split(".", 2)
        name = f"layers.{int(index) + first_layer}.{rest}"
    if name == "lm_head.weight" and (config.tie_word_embeddings or name not in hf):
        return _vocab_rows(hf["model.embed_tokens.weight"], config, where)
    hf_name = name if name.startswith("lm_head") else f"model.{name}"
    if name in ("lm_head.weight", "embed_tokens.weight"):
        return _vocab_rows(hf[hf_name], config, where)
    for fused, parts in _FUSED.items():
        if fused in hf_name:
            return torch.cat([_column_part(hf[hf_name.replace(fused, p)], p, config, where) for p in parts])
    if hf_name not in hf:
        raise KeyError(f"weight {hf_name} is missing from the checkpoint")
    tensor = hf[hf_name]
    if where.tp_size > 1 and hf_name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        inputs = config.num_heads * config.head_dim if "o_proj" in hf_name else config.intermediate_size
        start, end = shard(inputs, where.tp_size, where.tp_rank)  # row-parallel: a slice of the inputs
        return tensor[:, start:end].clone()  # a copy, so the full tensor is freed
    return tensor


def _column_part(tensor: torch.Tensor, part: str, config: ModelConfig, where: ParallelRank) -> torch.Tensor:
    """Column-parallel: this rank's output rows of q, k, v (by head) or gate, up (by MLP column)."""
    if where.tp_size == 1:
        return tensor
    d = config.head_dim
    if part.endswith("q_proj"):
        start, end = shard(config.num_heads, where.tp_size, where.tp_rank)
        return tensor[start * d : end * d]
    if part.endswith(("k_proj", "v_proj")):
        start, end = kv_head_range(config.num_kv_heads, where.tp_size, where.tp_rank)
        return tensor[start * d : end * d]
    start, end = shard(config.intermediate_size, where.tp_size, where.tp_rank)
    return tensor[start:end]


def _vocab_rows(tensor: torch.Tensor, config: ModelConfig, where: ParallelRank) -> torch.Tensor:
    if where.tp_size == 1:
        return tensor
    start, end = vocab_shard(config.vocab_size, where.tp_size, where.tp_rank)
    rows = tensor[start:end].clone()
    if rows.shape[0] < end - start:  # the last rank's padding rows score 0 and are cut off after the gather
        rows = torch.cat([rows, rows.new_zeros(end - start - rows.shape[0], rows.shape[1])])
    return rows
