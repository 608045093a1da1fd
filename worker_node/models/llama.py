"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache, with fused QKV and gate/up weights."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import AttentionBackend
from worker_node.attention import AttentionMetadata, paged_attention
from worker_node.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling:  # llama3: long wavelengths scaled down, short kept, a smooth ramp between
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(medium, scaled, inv_freq)
    return inv_freq


RopeAngles = tuple[torch.Tensor, torch.Tensor]


class Rotary(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """cos/sin of every token's position, looked up once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
    cos, sin = angles
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        angles: RopeAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        out = paged_attention(self.backend, q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        angles: RopeAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        angles = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, angles, kv_cache, meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
