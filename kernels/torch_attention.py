"""Paged attention in plain torch: the reference for the Triton kernels and the CPU worker's fast path.

Cache layout (shared by every backend): `[num_blocks, block_size, num_kv_heads, head_dim]`; a token at
position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, flat slot of each token
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as `[length, Hkv, D]`."""
    num_blocks = -(-length // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache including the query's own
    scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    max_blocks = -(-max_len // block_size)
    table = block_tables[:, :max_blocks].long()
    keys = k_cache[table].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
    values = v_cache[table].flatten(1, 2)[:, :max_len]
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys.float()) * scale
    pad = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None].long()
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, values.float())
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,  # [Tq, H, D], the new tokens of every sequence, concatenated
    k: torch.Tensor,  # [Tq, Hkv, D], their keys
    v: torch.Tensor,
    k_cache: torch.Tensor,  # holds each sequence's prefix (positions < seq_len - q_len)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32, offsets of each sequence's queries in q
    seq_lens: torch.Tensor,  # [S] int32, prefix + new tokens
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over their cached prefix plus themselves (chunked prefill, prefix hits)."""
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        q_len = hi - lo
        prefix = seq_len - q_len
        keys, values = k[lo:hi], v[lo:hi]
        if prefix:
            keys = torch.cat([gather_kv(k_cache, block_tables[i], prefix).to(k.dtype), keys])
            values = torch.cat([gather_kv(v_cache, block_tables[i], prefix).to(v.dtype), values])
        mask = None
        if prefix:
            rows = torch.arange(q_len, device=q.device)[:, None] + prefix
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        attn = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=not prefix,
            scale=scale,
            enable_gqa=True,
        )
        out[lo:hi] = attn.transpose(0, 1)
    return out
