"""Pieces shared by the Triton attention kernels: the paged gather, the online-softmax step, launch checks.

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

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def paged_offsets(table_row, cols, cmask, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr):
    """Element offsets in a `[num_blocks, block_size, Hkv, D]` cache of tokens `cols` of one sequence."""
    block = tl.load(table_row + cols // BLOCK_SIZE, mask=cmask, other=0).to(tl.int64)
    return block * stride_cb + (cols % BLOCK_SIZE) * stride_ct + kv_head * stride_ch


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
def online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, cap, mask, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold keys `k` [N, D] and values `v` [N, D] into the running max/sum/output of queries `q` [M, D]."""
    # "ieee" keeps fp32 inputs off TF32; fp16/bf16 inputs ignore it.
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
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
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validate what the kernels assume about q and the caches; return the GQA group size."""
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k_cache.shape[2]
    if head_dim not in (16, 32, 64, 128) or k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim must be 16, 32, 64 or 128 and match the cache, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and caches must share one of {SUPPORTED_DTYPES}, got {q.dtype}/{k_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    return num_heads // num_kv_heads


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
