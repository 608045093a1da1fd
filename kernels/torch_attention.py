"""Paged attention in plain torch: the reference for the Triton kernels and the CPU worker's fast path.

Cache layout (shared by every backend): `[num_blocks, block_size, num_kv_heads, head_dim]`; a token at
position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`. A quantized
cache (int8 or fp8 values) has its scales `[num_blocks, block_size, num_kv_heads]` beside it (kernels/kv_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_quant import as_bytes, dequantize, is_quantized, quantize


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, flat slot of each token
    *,
    k_scales: torch.Tensor | None = None,  # [N, block_size, Hkv] float32: a quantized cache's scales
    v_scales: torch.Tensor | None = None,
) -> None:
    _write_rows(key, k_cache, k_scales, slot_mapping)
    _write_rows(value, v_cache, v_scales, slot_mapping)


def _write_rows(rows: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> None:
    flat = as_bytes(cache).view(-1, *cache.shape[2:])
    if not is_quantized(cache.dtype):
        flat.index_copy_(0, slots, rows.to(cache.dtype))
        return
    if scales is None:
        raise ValueError(f"a {cache.dtype} KV cache is quantized: write_kv needs its scales")
    values, row_scales = quantize(rows, cache.dtype)
    flat.index_copy_(0, slots, as_bytes(values))
    scales.view(-1, scales.shape[2]).index_copy_(0, slots, row_scales)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as `[length, Hkv, D]`; dequantized to float32 when the
    cache's `scales` are given."""
    num_blocks = -(-length // cache.shape[1])
    blocks = block_table[:num_blocks].long()
    rows = cache[blocks].flatten(0, 1)[:length]
    return rows if scales is None else dequantize(rows, scales[blocks].flatten(0, 1)[:length])


def _read_blocks(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """Cache blocks `blocks` as float32 `[n, block_size, Hkv, D]` (dequantized when `scales` are given)."""
    num_cache_blocks = cache.shape[0]
    rows = cache.view(num_cache_blocks, -1).index_select(0, blocks).view(-1, *cache.shape[1:])
    if scales is None:
        return rows.float()
    return dequantize(rows, scales.view(num_cache_blocks, -1).index_select(0, blocks).view(-1, *scales.shape[1:]))


@dataclass(frozen=True, slots=True)
class _DecodeLayout:
    """Which cache blocks a decode batch reads, and whose they are: the same for every layer of a step."""

    block_tables: torch.Tensor  # the inputs it was built from (held, so their identity stays theirs)
    seq_lens: torch.Tensor
    blocks: torch.Tensor  # [N] every held block, sequence by sequence
    owner: torch.Tensor  # [N] the sequence each block belongs to
    positions: torch.Tensor  # [N, block_size] the position of each slot in its sequence
    owner_lens: torch.Tensor  # [N, 1] the length of each block's sequence
    padding: torch.Tensor  # [N, block_size] slots past the sequence's end

    def hidden(self, window: int) -> torch.Tensor:
        """[N, block_size] slots the query does not see: past the end, or (with a window) before it."""
        if not window:
            return self.padding
        return self.padding | (self.positions < self.owner_lens - window)


def decode_layout(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> _DecodeLayout:
    """Which blocks each sequence holds and where each slot sits in it: the same for every layer of a step, so
    the runner computes it once per step (the backend's `plan_decode`) and every layer reads it."""
    device = block_tables.device
    lens = seq_lens.long()
    num_blocks = (lens + block_size - 1) // block_size
    columns = torch.arange(block_tables.shape[1], device=device)
    held = columns[None, :] < num_blocks[:, None]
    owner = torch.repeat_interleave(torch.arange(len(lens), device=device), num_blocks)
    pos = columns.expand_as(held)[held][:, None] * block_size + torch.arange(block_size, device=device)[None, :]
    owner_lens = lens[owner][:, None]
    return _DecodeLayout(block_tables, seq_lens, block_tables[held].long(), owner, pos, owner_lens, pos >= owner_lens)


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's attention-score (and logit) soft-capping: smooth, and bounded by +-softcap."""
    return torch.tanh(scores / softcap) * softcap


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache including the query's own
    scale: float,
    *,
    window: int = 0,  # sliding window: the query sees its last `window` tokens (itself included); 0: all
    softcap: float = 0.0,  # scores become softcap * tanh(scores / softcap); 0: none
    k_scales: torch.Tensor | None = None,  # [N, block_size, Hkv] float32: a quantized cache's scales
    v_scales: torch.Tensor | None = None,
    plan: _DecodeLayout | None = None,  # decode_layout of these tables, computed once for the step
) -> torch.Tensor:
    """Attention block by block: only the blocks a sequence holds are read (no padding to the longest one);
    per-block partial softmaxes are merged per sequence, as the split-KV kernel does per segment."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    layout = plan if plan is not None else decode_layout(block_tables, seq_lens, block_size)
    owner = layout.owner
    keys = _read_blocks(k_cache, k_scales, layout.blocks)  # [N, bs, Hkv, D] float32
    values = _read_blocks(v_cache, v_scales, layout.blocks)
    qb = q.view(batch, num_kv_heads, group, head_dim).float().index_select(0, owner)  # [N, Hkv, G, D]
    scores = torch.einsum("nshd,nhgd->nhgs", keys, qb) * scale  # [N, Hkv, G, bs]
    if softcap:
        scores = soft_cap(scores, softcap)
    scores.masked_fill_(layout.hidden(window)[:, None, None, :], float("-inf"))
    seq_max = torch.full((batch, num_kv_heads, group), float("-inf"), device=q.device)
    seq_max.scatter_reduce_(0, owner[:, None, None].expand(-1, num_kv_heads, group), scores.amax(-1), "amax")
    # A block wholly outside the window scores -inf everywhere: its exp is 0 against its sequence's max.
    probs = torch.exp(scores - seq_max[owner][..., None])
    denom = torch.zeros(batch, num_kv_heads, group, device=q.device).index_add_(0, owner, probs.sum(-1))
    partial = torch.einsum("nhgs,nshd->nhgd", probs, values)  # [N, Hkv, G, D]
    out = torch.zeros(batch, num_kv_heads, group, head_dim, device=q.device).index_add_(0, owner, partial)
    return (out / denom[..., None]).reshape(batch, num_heads, head_dim).to(q.dtype)


@dataclass(frozen=True, slots=True)
class _PrefillLayout:
    """Each prefill sequence's query range and its causal mask over prefix + new tokens: the same for every
    layer of a step, so built once (host lists, no device sync per layer)."""

    cu_seqlens_q: torch.Tensor  # the inputs it was built from (held, so their identity stays theirs)
    seq_lens: torch.Tensor
    ranges: list[tuple[int, int, int]]  # (first query row, last query row + 1, cached prefix length)
    masks: list[torch.Tensor | None]  # [q_len, seq_len] bool where a prefix is cached; None: plain causal


_last_prefill: list[_PrefillLayout] = []  # one entry: the layout of the step in progress


def _prefill_layout(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> _PrefillLayout:
    last = _last_prefill[0] if _last_prefill else None  # read once: another thread may replace it
    if last is not None and last.cu_seqlens_q is cu_seqlens_q and last.seq_lens is seq_lens:
        return last
    starts = cu_seqlens_q.tolist()
    ranges, masks = [], []
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        prefix = seq_len - (hi - lo)
        ranges.append((lo, hi, prefix))
        masks.append(_visible(hi - lo, prefix, 0, seq_lens.device) if prefix else None)
    layout = _PrefillLayout(cu_seqlens_q, seq_lens, ranges, masks)
    _last_prefill[:] = [layout]
    return layout


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
    *,
    window: int = 0,  # as for decode
    softcap: float = 0.0,
    k_scales: torch.Tensor | None = None,  # as for decode: the cached prefix's scales
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their cached prefix plus themselves (chunked prefill, prefix hits)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    layout = _prefill_layout(cu_seqlens_q, seq_lens)
    for i, ((lo, hi, prefix), mask) in enumerate(zip(layout.ranges, layout.masks)):
        keys, values = k[lo:hi], v[lo:hi]
        if prefix:
            keys = torch.cat([gather_kv(k_cache, block_tables[i], prefix, k_scales).to(k.dtype), keys])
            values = torch.cat([gather_kv(v_cache, block_tables[i], prefix, v_scales).to(v.dtype), values])
        # Heads repeated rather than `enable_gqa`, and a batch dimension: that is what sends CPU SDPA to its
        # flash kernel instead of the math fallback (2-3x faster on prefill chunks).
        queries = q[lo:hi].transpose(0, 1)[None]
        keys, values = _repeat_heads(keys, group)[None], _repeat_heads(values, group)[None]
        if window:  # windows differ between layers: not part of the step's layout
            mask = _visible(hi - lo, prefix, window, q.device)
        if softcap:
            attn = _capped_attention(queries, keys, values, mask, scale, softcap)
        else:
            attn = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale
            )
        out[lo:hi] = attn[0].transpose(0, 1)
    return out


def _visible(q_len: int, prefix: int, window: int, device: torch.device) -> torch.Tensor:
    """[q_len, prefix + q_len]: the keys each new token sees (causal, and inside the window if one is set)."""
    rows = torch.arange(q_len, device=device)[:, None] + prefix
    cols = torch.arange(prefix + q_len, device=device)[None, :]
    visible = cols <= rows
    return visible & (cols > rows - window) if window else visible


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot apply: scores, cap, mask, softmax in float32."""
    scores = soft_cap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, softcap)
    if visible is None:
        visible = _visible(q.shape[-2], 0, 0, q.device)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def _repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """`[L, Hkv, D]` to `[Hkv * group, L, D]`, each kv head repeated for the query heads that share it."""
    x = x.transpose(0, 1)
    return x if group == 1 else x.repeat_interleave(group, dim=0)
