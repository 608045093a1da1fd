"""Pieces shared by the Triton attention kernels: the paged gather, the online-softmax step, launch checks.

A quantized cache (kernels/kv_quant.py) is read as stored, with its per-token scales folded into the scores and
the probabilities (`online_softmax_step`); its kernels are specialised on QUANT, so a full-precision cache's
kernels load no scale.

Importing this module imports triton; `kernels.backend` only imports it when the Triton backend is chosen.
Scores live in the log2 domain (`qk_scale` folds in log2(e)) so the kernels can use `exp2`.
"""

# Triton spells compile-time constants (tl.constexpr arguments) in upper case.
# ruff: noqa: N803

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.kv_quant import SCALE_DTYPE, is_quantized

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def load_paged_kv(
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
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Keys and values `[N, D]` of tokens `cols` of one sequence from `[num_blocks, block_size, Hkv, D]` caches, as
    stored, and (QUANT) their scales `[N]` from `[num_blocks, block_size, Hkv]`; without QUANT the scales are
    zeros nobody reads."""
    block = tl.load(table_row + cols // BLOCK_SIZE, mask=cmask, other=0).to(tl.int64)
    row = cols % BLOCK_SIZE
    off = block * stride_cb + row * stride_ct + kv_head * stride_ch
    k = tl.load(k_cache_ptr + off[:, None] + dims[None, :], mask=cmask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + off[:, None] + dims[None, :], mask=cmask[:, None], other=0.0)
    k_scale = tl.zeros_like(cols).to(tl.float32)
    v_scale = k_scale
    if QUANT:
        scale_off = block * stride_sb + row * stride_st + kv_head * stride_sh
        k_scale = tl.load(k_scales_ptr + scale_off, mask=cmask, other=0.0)
        v_scale = tl.load(v_scales_ptr + scale_off, mask=cmask, other=0.0)
    return k, v, k_scale, v_scale


NO_WINDOW = 1 << 30  # the window the kernels get for "none": wider than any sequence


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap) for `online_softmax_step`: plain scores are q.k * scale * log2(e); soft-capped ones
    softcap * tanh(q.k * scale / softcap), so the dot is scaled by scale / softcap and tanh's output by
    softcap * log2(e)."""
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def online_softmax_step(
    q,
    k,
    v,
    k_scale,
    v_scale,
    m_i,
    l_i,
    acc,
    qk_scale,
    cap,
    mask,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Fold keys `k` [N, D] and values `v` [N, D] into the running max/sum/output of queries `q` [M, D].

    QUANT: k and v are int8 or e4m3 values, exact in q's dtype; a key's scale `k_scale` [N] multiplies its
    scores and a value's scale `v_scale` [N] the probabilities that weigh it, so no tile is dequantized."""
    # "ieee" keeps fp32 inputs off TF32; fp16/bf16 inputs ignore it.
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
    if QUANT:
        qk = qk * k_scale[None, :]
    qk = qk * qk_scale
    if SOFTCAP:
        qk = cap * _tanh(qk)
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no visible key yet (a sliding window starts inside this tile) keeps m = -inf: its
    # exponentials are taken against 0 instead, so they come out 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return m_new, l_i, acc


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
) -> int:
    """Validate what the kernels assume about q, the caches and a quantized cache's scales; return the GQA group
    size."""
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k_cache.shape[2]
    if head_dim not in (16, 32, 64, 128) or k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim must be 16, 32, 64 or 128 and match the cache, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    cache_ok = k_cache.dtype == q.dtype or is_quantized(k_cache.dtype)
    if q.dtype not in SUPPORTED_DTYPES or not cache_ok or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q must be one of {SUPPORTED_DTYPES} and the caches q's dtype or quantized, got {q.dtype}/{k_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    check_scales(k_cache, k_scales, v_scales)
    return num_heads // num_kv_heads


def check_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    """A quantized cache has contiguous float32 scales `[num_blocks, block_size, Hkv]` for K and for V; a
    full-precision one has none."""
    if not is_quantized(k_cache.dtype):
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"a {k_cache.dtype} KV cache is not quantized: it takes no scales")
        return
    if k_scales is None or v_scales is None:
        raise ValueError(f"a {k_cache.dtype} KV cache is quantized: k_scales and v_scales are needed")
    for scales in (k_scales, v_scales):
        if scales.dtype != SCALE_DTYPE or scales.shape != k_cache.shape[:3] or not scales.is_contiguous():
            raise ValueError(f"scales must be contiguous {SCALE_DTYPE} {tuple(k_cache.shape[:3])}")


def scale_strides(k_cache: torch.Tensor, k_scales: torch.Tensor | None) -> tuple[int, int, int]:
    """The scales' strides for the kernels (zeros for a full-precision cache, whose scales are never read)."""
    if k_scales is None:
        return 0, 0, 0
    return k_scales.stride(0), k_scales.stride(1), k_scales.stride(2)


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
