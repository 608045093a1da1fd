"""AutoAWQ's packing of 4-bit codes, and the torch references of kernels/triton_quant_gemm.py: each quantized
weight dequantized in float32, rounded to the activations' dtype and multiplied by torch (what the layers of
worker_node/models/quant_awq.py and quant_int8.py compute where no kernel runs).

AutoAWQ packs eight 4-bit codes into an int32, nibble i (bits 4i..4i+3) holding output channel 8c + AWQ_ORDER[i] of
packed column c (interleaved for its CUDA kernel's unpacking).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds output channel AWQ_ORDER[i] of its eight
PACK = 8


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] of AWQ-packed nibbles -> int32 [R, 8C] codes 0..15 in channel order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8]: nibble i is channel AWQ_ORDER[i]
    codes = torch.empty_like(nibbles)
    codes[..., list(AWQ_ORDER)] = nibbles
    return codes.reshape(packed.shape[0], -1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int [R, 8C] codes 0..15 in channel order -> int32 [R, C] packed as AutoAWQ packs them (the inverse of unpack)."""
    rows, cols = codes.shape
    grouped = codes.to(torch.int64).reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (grouped << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the top nibble is the sign bit


def awq_weight(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] float32 = (code - zero) * scale, from codes [K, N], zeros and scales [K/G, N]."""
    g = group_size
    return ((codes - zeros.repeat_interleave(g, 0)).float() * scales.float().repeat_interleave(g, 0)).t()


def awq_gemm_reference(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] times the AWQ weight of AutoAWQ's tensors: [M, N] in x's dtype."""
    w = awq_weight(unpack(qweight), unpack(qzeros), scales, group_size)
    return F.linear(x, w.to(x.dtype))


def int8_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times int8 rows [N, K] with a scale per row: codes converted to x's dtype (exact), multiplied, each
    column scaled in float32."""
    return (F.linear(x, qweight.to(x.dtype)).float() * scales.float()).to(x.dtype)
