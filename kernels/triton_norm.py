"""Triton residual add + RMSNorm for GPU workers: one program per row, one launch per norm.

`add_rms_norm` is kernels/cpu_glue.py's `rms_norm` for CUDA tensors: (norm(x + delta) * (offset + weight), x +
delta), the sum and the norm in float32, the norm rounded once to the weight's dtype (the model's). x is the
residual stream, float32 in every model (worker_node/models/decoder.py's `residual_stream`), or any dtype equal
to the weight's; delta (a sub-block's output) is in the weight's dtype. torch's ops for a float32 stream and a bf16
weight take an add, the norm's reductions, a widened weight, a multiply and a cast, each a kernel in a decode
step's CUDA graph; this is one.
"""

# Triton spells compile-time constants (tl.constexpr arguments) in upper case.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_d,
    width,
    eps,
    offset,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        stored = (x + tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)).to(
            sum_ptr.dtype.element_ty
        )
        tl.store(sum_ptr + row * width + cols, stored, mask=mask)
        x = stored.to(tl.float32)  # the sum as stored (rounded, where the stream is in the model's dtype)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (x * inv_rms * (offset + weight)).to(out_ptr.dtype.element_ty), mask=mask)


def reads(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None) -> bool:
    """Whether `add_rms_norm` takes these: x [T, H] float32 or in the weight's dtype, with contiguous rows; a
    contiguous weight; delta None, or of x's shape in the weight's dtype with contiguous rows."""
    if x.dim() != 2 or x.dtype not in (torch.float32, weight.dtype) or x.stride(1) != 1 or not weight.is_contiguous():
        return False
    return delta is None or (delta.shape == x.shape and delta.dtype == weight.dtype and delta.stride(1) == 1)


def add_rms_norm(
    x: torch.Tensor,  # [T, H]: float32, or the weight's dtype; rows contiguous
    weight: torch.Tensor,  # [H]
    eps: float,
    offset: float = 0.0,
    delta: torch.Tensor | None = None,  # [T, H] in the weight's dtype; rows contiguous
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta): the norm in the weight's dtype, the sum (a new tensor) in x's; delta None:
    x's norm, and x itself."""
    if not reads(x, weight, None):
        raise ValueError(f"x must be float32 or {weight.dtype} with contiguous rows, got {x.dtype}, {x.stride()}")
    if not reads(x, weight, delta):
        raise ValueError(f"delta must be {weight.dtype} of x's shape {tuple(x.shape)} with contiguous rows")
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=weight.dtype, device=x.device)
    total = x if delta is None else torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            x if delta is None else delta,  # a placeholder the kernel never reads without HAS_DELTA
            weight,
            out,
            total,
            x.stride(0),
            0 if delta is None else delta.stride(0),
            width,
            eps,
            offset,
            HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(width),
        )
    return out, total
