"""Triton prefill attention: new tokens attend causally to their paged cached prefix plus themselves.

Grid (query tiles of every sequence, query heads), flattened over variable-length sequences without a host
sync: `cu_tiles` (built with device ops) maps a program to its sequence. Each program first sweeps the cached
prefix through the block table, then the new tokens' own keys from `k`/`v`: tiles wholly below the diagonal
without a mask, the diagonal tile(s) with the causal mask. A sliding window starts both sweeps where the tile's
first query starts seeing, and masks per query what it no longer sees; soft-capped scores pass through tanh. A
quantized cache's prefix is read with its per-token scales; the new tokens' own K/V are full precision.
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
    online_softmax_step,
    scale_strides,
    score_scales,
)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scales_ptr,
    v_scales_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    cu_tiles_ptr,
    out_ptr,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_sh,
    stride_bt,
    stride_ot,
    stride_oh,
    qk_scale,
    cap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seqs = tl.arange(0, SEQS_PAD)
    tile_ends = tl.load(cu_tiles_ptr + 1 + seqs, mask=seqs < num_seqs, other=2147483647)
    seq = tl.sum((tile_ends <= pid).to(tl.int32), 0)
    if seq >= num_seqs:
        return
    q_tile = pid - tl.load(cu_tiles_ptr + seq)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    prefix = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head // GROUP

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    dims = tl.arange(0, HEAD_DIM)
    q_off = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=rmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # With a sliding window, query row r (at position prefix + r) sees keys after prefix + r - window: the tile's
    # first row bounds where the sweeps start, and a mask takes off what its later rows must not see.
    seen_after = prefix + rows - window  # [BLOCK_M], per row: the last position it does not see
    table_row = block_tables_ptr + seq * stride_bt
    for n0 in range(tl.maximum(0, prefix + q_tile * BLOCK_M - window + 1), prefix, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < prefix
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
        visible = cmask[None, :]
        if WINDOWED:
            visible = visible & (cols[None, :] > seen_after[:, None])
        m_i, l_i, acc = online_softmax_step(
            q, k, v, k_scale, v_scale, m_i, l_i, acc, qk_scale, cap, visible, True, SOFTCAP, QUANT
        )

    # BLOCK_M is a multiple of BLOCK_N, so no key tile straddles the diagonal start. The new tokens' own keys and
    # values are full precision: no scales (`unscaled` is never read).
    diag = q_tile * BLOCK_M
    unscaled = tl.zeros([BLOCK_N], tl.float32)
    k_base = k_ptr + kv_head * stride_kh + dims[None, :]
    v_base = v_ptr + kv_head * stride_vh + dims[None, :]
    # New tokens below the diagonal: all visible without a window; with one, from the tile-aligned start of
    # what the first row sees, masked.
    for n0 in range(tl.maximum(0, diag - window + 1) // BLOCK_N * BLOCK_N, diag, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + (q_start + cols)[:, None] * stride_kt)
        v = tl.load(v_base + (q_start + cols)[:, None] * stride_vt)
        visible = (prefix + cols)[None, :] > seen_after[:, None]
        m_i, l_i, acc = online_softmax_step(
            q, k, v, unscaled, unscaled, m_i, l_i, acc, qk_scale, cap, visible, WINDOWED, SOFTCAP, False
        )
    for n0 in range(diag, tl.minimum(diag + BLOCK_M, q_len), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < q_len
        k = tl.load(k_base + (q_start + cols)[:, None] * stride_kt, mask=cmask[:, None], other=0.0)
        v = tl.load(v_base + (q_start + cols)[:, None] * stride_vt, mask=cmask[:, None], other=0.0)
        visible = (cols[None, :] <= rows[:, None]) & cmask[None, :]
        if WINDOWED:
            visible = visible & ((prefix + cols)[None, :] > seen_after[:, None])
        m_i, l_i, acc = online_softmax_step(
            q, k, v, unscaled, unscaled, m_i, l_i, acc, qk_scale, cap, visible, True, SOFTCAP, False
        )

    # Padding rows past q_len may see no key at all inside a window (sum 0); they are not stored, only not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def _tile_config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); small tiles in the interpreter so tiny tests cross them."""
    if device.type != "cuda":
        return 32, 16, 4, 1
    if dtype == torch.float32:  # a correctness dtype: exact fp32 dots run on FMA units and spill some
        return 64, 32, 4, 2
    return 128, 64, 8, 3  # with 4 warps head_dim 64 sits at 250 registers on sm_90, 8 leaves headroom


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
    window: int = 0,  # sliding window: each query sees its last `window` tokens (itself included); 0: all
    softcap: float = 0.0,  # scores become softcap * tanh(scores / softcap); 0: none
    k_scales: torch.Tensor | None = None,  # [N, block_size, Hkv] float32: a quantized cache's scales
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their cached prefix plus themselves (chunked prefill, prefixes)."""
    total_q, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    group = check_attention_inputs(q, k_cache, v_cache, k_scales, v_scales)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("k and v must match q's dtype and be contiguous along head_dim")
    out = torch.empty_like(q)
    if total_q == 0 or num_seqs == 0:
        return out
    block_m, block_n, num_warps, num_stages = _tile_config(q.dtype, q.device)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    cu_tiles = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    cu_tiles[1:] = torch.cumsum((q_lens + block_m - 1) // block_m, 0)
    # Each sequence wastes at most one partial tile, so this bounds the real tile count without a sync.
    max_tiles = triton.cdiv(total_q, block_m) + num_seqs
    _prefill_kernel[(max_tiles, num_heads)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        k_cache if k_scales is None else k_scales,  # full precision: a placeholder the kernel never reads
        v_cache if v_scales is None else v_scales,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        cu_tiles,
        out,
        num_seqs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *scale_strides(k_cache, k_scales),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *score_scales(scale, softcap),
        window or NO_WINDOW,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SEQS_PAD=triton.next_power_of_2(num_seqs),
        WINDOWED=bool(window),
        SOFTCAP=bool(softcap),
        QUANT=k_scales is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
