"""Mixtral: the Llama layer with its MLP replaced by a sparse mixture of experts.

A router scores every expert per token; each token goes to its top-k experts, whose outputs are summed with the
softmax probabilities of those k renormalised to 1 (as HF's MixtralTopKRouter does, in float32). Under tensor
parallelism the router is replicated and every rank holds a 1/T slice of each expert's intermediate dim (its
columns of w1/w3, its rows of w2): a rank runs the experts its tokens chose on its slice, and the all-reduce that
follows sums the slices, exactly as for a dense MLP. Every rank routes identically, so no tokens move.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.interface import AttentionBackend
from worker_node.kv.cache import LayerKV
from worker_node.models.attention import AttentionMetadata
from worker_node.models.config import ModelConfig
from worker_node.models.decoder import CausalLM, DecoderLayer
from worker_node.models.layers import ACTIVATIONS, Attention, RMSNorm, RopeAngles
from worker_node.runtime.parallel import Comm, ParallelRank


class Experts(nn.Module):
    """Every expert's weights stacked: gate/up fused [E, 2 * I/T, H] (column-parallel), down [E, H, I/T]."""

    def __init__(self, config: ModelConfig, where: ParallelRank) -> None:
        super().__init__()
        self.inter = config.intermediate_size // where.tp_size
        e, h = config.num_experts, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * self.inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, self.inter))
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, top_experts: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(x); tokens grouped by expert, in expert order."""
        k = top_experts.shape[1]
        flat = top_experts.flatten()
        order = flat.argsort()
        tokens = order // k
        weights = top_weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[start : start + n]
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).split(self.inter, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[expert]) * weights[start : start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, where: ParallelRank, comm: Comm) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router, replicated
        self.experts = Experts(config, where)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        top_weights /= top_weights.sum(dim=-1, keepdim=True)
        return self.comm.all_reduce(self.experts(x, top_experts, top_weights))


class MixtralDecoderLayer(DecoderLayer):
    def __init__(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, where: ParallelRank, comm: Comm
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, backend, where, comm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = SparseMoE(config, where, comm)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        angles: RopeAngles,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = self.input_layernorm.add(x, delta)
        h, x = self.post_attention_layernorm.add(x, self.self_attn(h, angles, kv_cache, meta))
        return x, self.block_sparse_moe(h)


class MixtralForCausalLM(CausalLM):
    def make_layer(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, where: ParallelRank, comm: Comm
    ) -> DecoderLayer:
        return MixtralDecoderLayer(config, layer, backend, where, comm)
