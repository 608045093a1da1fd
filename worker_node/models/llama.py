"""The Llama family: Llama, Mistral, Qwen2, Qwen3 and Phi-3 share one pre-norm layer (attention, then a gated
MLP, each after an RMSNorm and added to the residual).

What tells them apart is configuration (biases, sliding windows, partial RoPE) or small switches: Qwen3 norms
each head's query and key; Phi-3 checkpoints store q/k/v and gate/up already fused (the loader reads either).
"""

from __future__ import annotations

import torch

from kernels.interface import AttentionBackend
from worker_node.kv.cache import LayerKV
from worker_node.models.attention import AttentionMetadata
from worker_node.models.config import ModelConfig
from worker_node.models.decoder import CausalLM, DecoderLayer
from worker_node.models.layers import MLP, Attention, RMSNorm, RopeAngles
from worker_node.runtime.parallel import Comm, ParallelRank


class LlamaDecoderLayer(DecoderLayer):
    runs_natively = True  # worker_node/models/native_decode.py runs this forward in C (a subclass must say so too)

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        backend: AttentionBackend,
        where: ParallelRank,
        comm: Comm,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, backend, where, comm, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, where, comm)

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
        return x, self.mlp(h)


class LlamaForCausalLM(CausalLM):
    qk_norm = False

    def make_layer(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, where: ParallelRank, comm: Comm
    ) -> DecoderLayer:
        return LlamaDecoderLayer(config, layer, backend, where, comm, self.qk_norm)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
