"""One LoRA adapter's tensors (read and checked: worker_node/lora/checked_read.py) laid out for our fused projections
on this rank.

Our models fuse q/k/v and gate/up; an adapter adapts HF's separate modules. For each fused projection an adapter
gets one `ProjectionLora`: A is its parts' A stacked ([sum of r, in]), B is [this rank's outputs, sum of r] with
part p's rows only in part p's columns, the scale folded in. Tensor parallelism cuts them like their base layers:
a column-parallel projection (q/k/v, gate/up) keeps this rank's output rows of B (A whole), a row-parallel one (o,
down) this rank's input columns of A (B whole): the all-reduce after o/down adds the ranks' partial deltas up, as
it adds their partial base outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from proto.lora import AdapterInfo
from proto.parallel import kv_head_range, shard
from worker_node.models.config import ModelConfig
from worker_node.runtime.parallel import ParallelRank

# Our fused projection -> (its block, the HF modules it fuses, in output order).
PROJECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ProjectionLora:
    """One adapter's update of one fused projection on this rank: output += x @ a^T @ b^T."""

    a: torch.Tensor  # [sum of r, in]
    b: torch.Tensor  # [out, sum of r], scaled

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


LayerLoras = dict[tuple[int, str], ProjectionLora]  # (this stage's layer index, fused projection) -> its update


def adapter_updates(
    info: AdapterInfo,
    tensors: Mapping[str, torch.Tensor],
    config: ModelConfig,
    where: ParallelRank,
    first_layer: int,
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LayerLoras:
    """The updates of this stage's layers (`first_layer` on, `num_layers` of them), this rank's slices, from the
    adapter's checked tensors (worker_node/lora/checked_read.py: read whole, once, never from the file here)."""
    out: LayerLoras = {}
    for fused, (_, parts) in PROJECTIONS.items():
        for layer in range(first_layer, first_layer + num_layers):
            found = [(p, info.modules[(layer, p)]) for p in parts if (layer, p) in info.modules]
            if not found:
                continue
            sizes = [_outputs(p, config, where) for p in parts]
            a_parts, b_parts = [], []
            for part, (a_name, b_name) in found:
                a, b = tensors[a_name].float(), tensors[b_name].float() * info.scale
                a, b = _slice(part, a, b, config, where)
                offset = sum(sizes[: parts.index(part)])
                full_b = torch.zeros(sum(sizes), b.shape[1])
                full_b[offset : offset + b.shape[0]] = b
                a_parts.append(a)
                b_parts.append(full_b)
            a = torch.cat(a_parts).to(device=device, dtype=dtype)
            b = torch.cat(b_parts, dim=1).to(device=device, dtype=dtype)
            out[(layer - first_layer, fused)] = ProjectionLora(a, b)
    return out


def projection_shape(fused: str, config: ModelConfig, where: ParallelRank) -> tuple[int, int]:
    """(inputs, outputs) of one fused projection on this rank: the columns of its adapters' A, the rows of their B."""
    outputs = sum(_outputs(part, config, where) for part in PROJECTIONS[fused][1])
    if fused in ROW_PARALLEL:
        inputs = config.num_heads * config.head_dim if fused == "o_proj" else config.intermediate_size
        start, end = shard(inputs, where.tp_size, where.tp_rank)
        return end - start, outputs
    return config.hidden_size, outputs


def _outputs(part: str, config: ModelConfig, where: ParallelRank) -> int:
    """The outputs of one HF module on this rank."""
    t, r, d = where.tp_size, where.tp_rank, config.head_dim
    if part == "q_proj":
        start, end = shard(config.num_heads, t, r)
        return (end - start) * d
    if part in ("k_proj", "v_proj"):
        start, end = kv_head_range(config.num_kv_heads, t, r)
        return (end - start) * d
    if part in ("gate_proj", "up_proj"):
        start, end = shard(config.intermediate_size, t, r)
        return end - start
    return config.hidden_size  # o_proj, down_proj: row-parallel, every output


def _slice(
    part: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig, where: ParallelRank
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B of one module: B's output rows (column-parallel) or A's input columns (row-parallel)."""
    t, r, d = where.tp_size, where.tp_rank, config.head_dim
    if t == 1:
        return a, b
    if part in ("o_proj", "down_proj"):
        inputs = config.num_heads * d if part == "o_proj" else config.intermediate_size
        start, end = shard(inputs, t, r)
        return a[:, start:end], b
    if part == "q_proj":
        start, end = shard(config.num_heads, t, r)
        return a, b[start * d : end * d]
    if part in ("k_proj", "v_proj"):
        start, end = kv_head_range(config.num_kv_heads, t, r)
        return a, b[start * d : end * d]
    start, end = shard(config.intermediate_size, t, r)
    return a, b[start:end]
