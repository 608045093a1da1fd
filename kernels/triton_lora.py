"""Triton kernels adding each token's LoRA adapter to a projection's output, many adapters in one launch (the
batched gather of Punica's BGMV): a shrink `x A_s^T` into a float32 buffer of the widest adapter's rank, then an
expand `base + xa B_s^T` into a new output. One program per token (and per block of ranks or outputs) reads only
its own adapter's rows of the stacks, so a mixed batch costs each token its own adapter's rank, not the sum over
the resident adapters. The torch reference is kernels/torch_lora.py (the same arguments).
"""

# Triton spells compile-time constants (tl.constexpr arguments) in upper case.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # ranks per program of the shrink, and per step of the expand's loop
BLOCK_K = 64  # inputs per step of the shrink's loop
BLOCK_N = 64  # outputs per program of the expand


@triton.jit
def _width_of(token_slots_ptr, starts_ptr, widths_ptr, token, NUM_SLOTS: tl.constexpr):
    """(start, width) of the token's adapter; width 0 for the base model (slot -1) or an empty slot."""
    slot = tl.load(token_slots_ptr + token)
    valid = (slot >= 0) & (slot < NUM_SLOTS)
    safe = tl.where(valid, slot, 0)
    start = tl.load(starts_ptr + safe)
    width = tl.where(valid, tl.load(widths_ptr + safe), 0)
    return start, width


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, xa_ptr, token_slots_ptr, starts_ptr, widths_ptr,
    stride_xt, stride_ar, stride_xat, IN,
    NUM_SLOTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    block = tl.program_id(1)
    start, width = _width_of(token_slots_ptr, starts_ptr, widths_ptr, token, NUM_SLOTS)
    ranks = block * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = ranks < width
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if block * BLOCK_R < width:
        rows = (start + ranks).to(tl.int64) * stride_ar
        for k0 in range(0, IN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < IN
            x = tl.load(x_ptr + token.to(tl.int64) * stride_xt + ks, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + rows[:, None] + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], 1)
    tl.store(xa_ptr + token.to(tl.int64) * stride_xat + ranks, acc)  # zeros past the width: never read


@triton.jit
def _expand_kernel(
    base_ptr, xa_ptr, b_ptr, y_ptr, token_slots_ptr, starts_ptr, widths_ptr,
    stride_bt, stride_xat, stride_bn, stride_yt, OUT,
    NUM_SLOTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = outs < OUT
    start, width = _width_of(token_slots_ptr, starts_ptr, widths_ptr, token, NUM_SLOTS)
    acc = tl.load(base_ptr + token.to(tl.int64) * stride_bt + outs, mask=nmask, other=0.0).to(tl.float32)
    for r0 in range(0, width, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rmask = ranks < width
        xa = tl.load(xa_ptr + token.to(tl.int64) * stride_xat + ranks, mask=rmask, other=0.0)
        cols = start + ranks
        b = tl.load(
            b_ptr + outs.to(tl.int64)[:, None] * stride_bn + cols[None, :],
            mask=nmask[:, None] & rmask[None, :],
            other=0.0,
        )
        acc += tl.sum(b.to(tl.float32) * xa[None, :], 1)
    tl.store(y_ptr + token.to(tl.int64) * stride_yt + outs, acc.to(y_ptr.dtype.element_ty), mask=nmask)


def lora_add(
    base: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    starts: torch.Tensor,
    widths: torch.Tensor,
    max_width: int,
) -> torch.Tensor:
    """`base` `[T, out]` plus each token's adapter update, as kernels/torch_lora.py's reference (a new tensor).
    `max_width`: the widest adapter in the stack (widths' max, known on the host without a device sync)."""
    if x.dim() != 2 or base.dim() != 2 or x.shape[0] != base.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and base {tuple(base.shape)} must be [T, in] and [T, out]")
    if a.shape[1] != x.shape[1] or b.shape[0] != base.shape[1] or a.shape[0] != b.shape[1]:
        raise ValueError(f"stacks A {tuple(a.shape)}, B {tuple(b.shape)} do not fit x {tuple(x.shape)}")
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    base = base.contiguous()
    tokens, out = base.shape
    y = torch.empty_like(base)
    if tokens == 0:
        return y
    rank_blocks = max(1, triton.cdiv(max_width, BLOCK_R))
    xa = torch.empty(tokens, rank_blocks * BLOCK_R, dtype=torch.float32, device=x.device)
    slots, starts, widths = token_slots.contiguous(), starts.contiguous(), widths.contiguous()
    _shrink_kernel[(tokens, rank_blocks)](
        x, a, xa, slots, starts, widths, x.stride(0), a.stride(0), xa.stride(0), x.shape[1],
        NUM_SLOTS=len(widths), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _expand_kernel[(tokens, triton.cdiv(out, BLOCK_N))](
        base, xa, b, y, slots, starts, widths, base.stride(0), xa.stride(0), b.stride(0), y.stride(0), out,
        NUM_SLOTS=len(widths), BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return y
