"""Triton paged decode attention, split-KV (flash-decoding).

Grid (batch, kv_heads, segments): each program takes one query token's GQA group (every query head that
shares one KV head, so K/V are read once for the group) over one segment of the sequence, and writes a partial
max, sum and unnormalised output; a second kernel merges the segments. With a single segment the first
kernel writes the final output itself. With a sliding window each segment starts at the window's first token
(a segment wholly before it writes an empty partial); soft-capped scores pass through tanh. A quantized cache's
per-token scales are read beside its values (kernels/triton_common.py).
"""

# Triton spells compile-time constants (tl.constexpr arguments) in upper case.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    NO_WINDOW,
    check_attention_inputs,
    load_paged_kv,
    multiprocessor_count,
    online_softmax_step,
    scale_strides,
    score_scales,
)

MAX_SEGMENTS = 64  # bounds the merge kernel's registers: it holds [segments, head_dim] partials at once
PROGRAMS_PER_SM = 4


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scales_ptr,
    v_scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_sh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_mb,
    stride_mh,
    qk_scale,
    cap,
    window,
    seg_tokens,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + batch)
    start = seg * seg_tokens
    if start >= seq_len:
        return
    end = tl.minimum(start + seg_tokens, seq_len)
    # A sliding window: the segment's tokens before it are skipped (a segment wholly before it writes an empty
    # partial, which the merge weighs 0).
    first = tl.maximum(start, seq_len - window)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    gmask = g < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_off = batch * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=gmask[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + batch * stride_bt
    for n0 in range(first, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < end
        k, v, k_scale, v_scale = load_paged_kv(
            k_cache_ptr,
            v_cache_ptr,
            k_scales_ptr,
            v_scales_ptr,
            table_row,
            cols,
            cmask,
            kv_head,
            dims,
            stride_cb,
            stride_ct,
            stride_ch,
            stride_sb,
            stride_st,
            stride_sh,
            BLOCK_SIZE,
            QUANT,
        )
        m_i, l_i, acc = online_softmax_step(
            q, k, v, k_scale, v_scale, m_i, l_i, acc, qk_scale, cap, cmask[None, :], True, SOFTCAP, QUANT
        )

    o_off = batch * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        tl.store(o_ptr + o_off + seg * stride_os, acc, mask=gmask[:, None])
        ml_off = batch * stride_mb + heads * stride_mh + seg
        tl.store(m_ptr + ml_off, m_i, mask=gmask)
        tl.store(l_ptr + ml_off, l_i, mask=gmask)


@triton.jit
def _decode_merge_kernel(
    o_part_ptr,
    m_ptr,
    l_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    stride_ob,
    stride_oh,
    seg_tokens,
    HEAD_DIM: tl.constexpr,
    SEG_PAD: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + batch)
    num_segs = (seq_len + seg_tokens - 1) // seg_tokens
    segs = tl.arange(0, SEG_PAD)
    smask = segs < num_segs
    dims = tl.arange(0, HEAD_DIM)
    ml_off = batch * stride_mb + head * stride_mh + segs
    m = tl.load(m_ptr + ml_off, mask=smask, other=float("-inf"))
    l_seg = tl.load(l_ptr + ml_off, mask=smask, other=0.0)
    weight = tl.where(smask, tl.exp2(m - tl.max(m, 0)), 0.0)
    p_off = batch * stride_pb + head * stride_ph + segs[:, None] * stride_ps + dims[None, :]
    parts = tl.load(o_part_ptr + p_off, mask=smask[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(l_seg * weight, 0)
    tl.store(out_ptr + batch * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def _tile_config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages); the interpreter gets small tiles so tiny tests cross tiles."""
    if device.type != "cuda":
        return 16, 4, 1
    if dtype == torch.float32:
        return 32, 4, 2
    return 64, 4, 3


def choose_num_segments(batch: int, num_kv_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Enough segments to give every SM a few programs, none shorter than one tile, at most MAX_SEGMENTS."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * multiprocessor_count(device), batch * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_len, block_n), MAX_SEGMENTS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1, tokens in the cache including the query's own
    scale: float,
    *,
    window: int = 0,  # sliding window: the query sees its last `window` tokens (itself included); 0: all
    softcap: float = 0.0,  # scores become softcap * tanh(scores / softcap); 0: none
    k_scales: torch.Tensor | None = None,  # [N, block_size, Hkv] float32: a quantized cache's scales
    v_scales: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Split-KV decode. Segments are sized from the block table's width (no device sync, graph friendly)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = check_attention_inputs(q, k_cache, v_cache, k_scales, v_scales)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_n, num_warps, num_stages = _tile_config(q.dtype, q.device)
    max_len = block_tables.shape[1] * block_size
    if num_segments is None:
        num_segments = choose_num_segments(batch, num_kv_heads, max_len, block_n, q.device)
    seg_tokens = block_n * triton.cdiv(triton.cdiv(max_len, num_segments), block_n)
    num_segments = triton.cdiv(max_len, seg_tokens)
    direct = num_segments == 1
    if direct:
        o_part, m_part, l_part = out, out, out
        part_strides: tuple[int, ...] = (out.stride(0), out.stride(1), 0, 0, 0)
    else:
        o_part = torch.empty((batch, num_heads, num_segments, head_dim), dtype=torch.float32, device=q.device)
        m_part = torch.empty((batch, num_heads, num_segments), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        part_strides = (*o_part.stride()[:3], *m_part.stride()[:2])
    _decode_split_kernel[(batch, num_kv_heads, num_segments)](
        q,
        k_cache,
        v_cache,
        k_cache if k_scales is None else k_scales,  # full precision: a placeholder the kernel never reads
        v_cache if v_scales is None else v_scales,
        block_tables,
        seq_lens,
        o_part,
        m_part,
        l_part,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *scale_strides(k_cache, k_scales),
        block_tables.stride(0),
        *part_strides,
        *score_scales(scale, softcap),
        window or NO_WINDOW,
        seg_tokens,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DIRECT=direct,
        SOFTCAP=bool(softcap),
        QUANT=k_scales is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            o_part,
            m_part,
            l_part,
            seq_lens,
            out,
            *part_strides,
            out.stride(0),
            out.stride(1),
            seg_tokens,
            HEAD_DIM=head_dim,
            SEG_PAD=triton.next_power_of_2(num_segments),
            num_warps=4,
        )
    return out
