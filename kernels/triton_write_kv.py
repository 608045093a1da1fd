"""Triton scatter of new keys/values into the paged KV cache (one program per token, all KV heads).

A quantized cache (kernels/kv_quant.py) gets each token's head rows as int8 or e4m3 values and one float32 scale
per head, max|x| / QMAX, in the same slot of the scales; the rounding is the torch reference's (but for exact
ties among e4m3's subnormals, see `_round_to_e4m3`).
"""

# Triton spells compile-time constants (tl.constexpr arguments) in upper case.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import MIN_ABSMAX, QMAX
from kernels.triton_common import check_scales, scale_strides

_MIN_ABSMAX = tl.constexpr(MIN_ABSMAX)


@triton.jit
def _round_to_e4m3(y):
    """float32 `y` (|y| <= 448) rounded to the nearest e4m3 value, still float32, so the cast after it is exact.

    Triton's interpreter rounds float32 -> e4m3 casts without carrying into the exponent (126.8 becomes 64), so
    the CPU tests could not check the GPU's cast; rounded here first, both write the bytes torch writes. Normal
    values: ties to even on the float32 bits, 3 mantissa bits kept; e4m3's subnormals (below 2^-6) are
    multiples of 2^-9, their exact ties rounded up."""
    magnitude = tl.abs(y)
    bits = magnitude.to(tl.int32, bitcast=True)
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = kept.to(tl.float32, bitcast=True)
    subnormal = tl.floor(magnitude * 512.0 + 0.5) / 512.0
    rounded = tl.where(magnitude >= 0.015625, normal, subnormal)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit: -0 stays -0


@triton.jit
def _store_rows(rows, cache_ptr, scales_ptr, dst, scale_dst, mask, hmask, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """Rows `[HEADS_PAD, D]` into the cache at `dst`; quantized (with their scales at `scale_dst`) when QUANT."""
    if QUANT:
        rows = rows.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(rows), 1), _MIN_ABSMAX) / QMAX
        rows = tl.minimum(tl.maximum(rows / scale[:, None], -QMAX), QMAX)
        if cache_ptr.dtype.element_ty == tl.int8:
            rows = tl.floor(rows + 0.5)
        else:
            rows = _round_to_e4m3(rows)
        tl.store(scales_ptr + scale_dst, scale, mask=hmask)
    tl.store(cache_ptr + dst, rows.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scales_ptr,
    v_scales_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    stride_ss,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding tokens (e.g. in a captured CUDA graph) own no slot
        return
    heads = tl.arange(0, HEADS_PAD)
    hmask = heads < NUM_KV_HEADS
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = hmask[:, None]
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims, mask=mask)
    dst = slot * stride_cs + heads[:, None] * stride_ch + dims
    scale_dst = slot * stride_ss + heads * stride_sh
    _store_rows(key, k_cache_ptr, k_scales_ptr, dst, scale_dst, mask, hmask, QUANT, QMAX)
    _store_rows(value, v_cache_ptr, v_scales_ptr, dst, scale_dst, mask, hmask, QUANT, QMAX)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, flat slot of each token; negative slots are skipped
    *,
    k_scales: torch.Tensor | None = None,  # [N, block_size, Hkv] float32: a quantized cache's scales
    v_scales: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not k_cache.is_contiguous():
        raise ValueError("key/value must be contiguous along head_dim and the caches fully contiguous")
    if k_cache.shape != v_cache.shape or not v_cache.is_contiguous() or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype and be contiguous")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    check_scales(k_cache, k_scales, v_scales)
    _, stride_ss, stride_sh = scale_strides(k_cache, k_scales)  # contiguous scales: a slot's stride is a token's
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_cache if k_scales is None else k_scales,  # full precision: a placeholder the kernel never reads
        v_cache if v_scales is None else v_scales,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        stride_ss,
        stride_sh,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        QUANT=k_scales is not None,
        QMAX=QMAX.get(k_cache.dtype, 0.0),
    )
