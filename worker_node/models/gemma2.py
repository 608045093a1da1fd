"""Gemma 2: the Llama layer with "sandwich" norms (each sub-block's output normed again before the residual),
norms that scale by 1 + weight, embeddings scaled by sqrt(hidden), GeGLU (tanh GELU), attention scaled by
query_pre_attn_scalar ** -0.5, soft-capped attention scores and logits, and sliding-window layers alternating
with global ones. The numbers come from the config; this file holds the structure.
"""

from __future__ import annotations

import math

import torch

from kernels.interface import AttentionBackend
from worker_node.kv.cache import LayerKV
from worker_node.models.attention import AttentionMetadata
from worker_node.models.config import ModelConfig
from worker_node.models.decoder import CausalLM, DecoderLayer
from worker_node.models.layers import MLP, Attention, RMSNorm, RopeAngles
from worker_node.runtime.parallel import Comm, ParallelRank

NORM_OFFSET = 1.0


class Gemma2DecoderLayer(DecoderLayer):
    def __init__(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, where: ParallelRank, comm: Comm
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, NORM_OFFSET)
        self.self_attn = Attention(config, layer, backend, where, comm)
        self.post_attention_layernorm = RMSNorm(h, eps, NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, NORM_OFFSET)
        self.mlp = MLP(config, where, comm)
        self.post_feedforward_layernorm = RMSNorm(h, eps, NORM_OFFSET)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        angles: RopeAngles,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = self.input_layernorm.add(x, delta)
        attended = self.post_attention_layernorm(self.self_attn(h, angles, kv_cache, meta))
        h, x = self.pre_feedforward_layernorm.add(x, attended)
        return x, self.post_feedforward_layernorm(self.mlp(h))


class Gemma2ForCausalLM(CausalLM):
    norm_offset = NORM_OFFSET

    def make_layer(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, where: ParallelRank, comm: Comm
    ) -> DecoderLayer:
        return Gemma2DecoderLayer(config, layer, backend, where, comm)

    @staticmethod
    def embedding_scale(config: ModelConfig) -> float:
        return math.sqrt(config.hidden_size)
