"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache, with fused QKV and gate/up weights.

Written against tensor and pipeline parallelism: QKV and gate/up are column-parallel (each TP rank holds its
heads and its slice of the MLP), O and down are row-parallel followed by an all-reduce, the embedding and the
LM head are vocab-parallel. A pipeline stage holds only its decoder layers (`layers[i]` is the checkpoint's
layer `first_layer + i`); the first stage embeds, the last one normalises and computes logits. With one worker every
collective is a no-op and the model is the plain one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import AttentionBackend
from proto.parallel import kv_head_range, shard, vocab_shard
from worker_node.attention import AttentionMetadata, paged_attention
from worker_node.models.config import ModelConfig
from worker_node.parallel import SINGLE, Comm, ParallelRank


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
    """This TP rank's query heads and the KV heads they read (split, or one replicated when T > Hkv)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, where: ParallelRank, comm: Comm) -> None:
        super().__init__()
        q0, q1 = shard(config.num_heads, where.tp_size, where.tp_rank)
        kv0, kv1 = kv_head_range(config.num_kv_heads, where.tp_size, where.tp_rank)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, kv1 - kv0, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)  # row-parallel
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.comm = comm

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
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, where: ParallelRank, comm: Comm) -> None:
        super().__init__()
        self.inter = config.intermediate_size // where.tp_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)  # column-parallel
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)  # row-parallel
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.comm.all_reduce(self.down_proj(F.silu(gate) * up))


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds ceil(V / T) vocab rows; tokens outside them embed to zero, the all-reduce fills in."""

    def __init__(self, vocab_size: int, hidden_size: int, where: ParallelRank, comm: Comm) -> None:
        super().__init__()
        self.start, end = vocab_shard(vocab_size, where.tp_size, where.tp_rank)
        self.weight = nn.Parameter(torch.empty(end - self.start, hidden_size))
        self.sharded = where.tp_size > 1
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Each TP rank scores its vocab rows; TP rank 0 gathers the full logits (the others get None)."""

    def __init__(self, vocab_size: int, hidden_size: int, where: ParallelRank, comm: Comm) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        start, end = vocab_shard(vocab_size, where.tp_size, where.tp_rank)
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if logits.dtype != torch.float32:
            logits = rescore_top_logits(logits, hidden, self.weight)
        gathered = self.comm.gather_to_first(logits)
        return None if gathered is None else gathered[:, : self.vocab_size]


RESCORED_LOGITS = 8


def rescore_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits whose top candidates are recomputed in float32 from the same bf16/fp16 operands.

    A bf16 logit is rounded to a step of 1/16 to 1/8 at the magnitudes of a model's best tokens (8 to 32), so
    near-ties would resolve by token id instead of by score; the top few of each row (each TP rank's own vocab
    rows, whose union holds the global top) are cheap to score exactly, the rest keep their rounded values.
    """
    top = logits.topk(min(RESCORED_LOGITS, logits.shape[-1]), dim=-1).indices  # [B, k]
    exact = torch.einsum("bd,bkd->bk", hidden.float(), weight[top].float())
    return logits.float().scatter_(1, top, exact)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, where: ParallelRank, comm: Comm) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, where, comm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, where, comm)

    def forward(
        self,
        x: torch.Tensor,
        angles: RopeAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class StepInterrupted(Exception):
    """The forward pass stopped at a layer boundary because the scheduler interrupted its step."""


class LlamaForCausalLM(nn.Module):
    embed_tokens: VocabParallelEmbedding | None
    norm: RMSNorm | None
    lm_head: ParallelLMHead | None

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        where: ParallelRank = SINGLE,
        comm: Comm | None = None,
    ) -> None:
        super().__init__()
        comm = comm or Comm(where)
        self.config = config
        self.where = where
        h, v = config.hidden_size, config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(v, h, where, comm) if where.is_first_stage else None
        self.first_layer, end = where.layout.layer_range(where.stage, config.num_layers)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, where, comm) for _ in range(self.first_layer, end))
        self.norm = RMSNorm(h, config.rms_norm_eps) if where.is_last_stage else None
        self.lm_head = ParallelLMHead(v, h, where, comm) if where.is_last_stage else None
        if config.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # this stage's layers, in order
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # [T, hidden]: the previous stage's output (not on the first)
        interrupted: Callable[[], bool] | None = None,  # asked before each layer; True raises StepInterrupted
    ) -> torch.Tensor:
        """This stage's part of the forward pass: normalised hidden states on the last stage, raw ones before."""
        if hidden is None:
            if self.embed_tokens is None:
                raise RuntimeError("a stage after the first needs the previous stage's hidden states")
            hidden = self.embed_tokens(input_ids)
        x = hidden
        angles = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            if interrupted is not None and interrupted():
                raise StepInterrupted
            x = layer(x, angles, kv_cache, meta)
        return x if self.norm is None else self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits on the output rank; None on the other TP ranks of the last stage."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        return self.lm_head(hidden)
