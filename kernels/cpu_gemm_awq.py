"""AWQ int4 matrix products on CPU (kernels/csrc/awq_gemm_cpu.c): `x @ w.T` with 4-bit weights widened in registers.

`repack` turns AWQ's codes, zero points and group scales into the kernel's layout once at load (described in the
C source): codes uint8 [N/16, K/4, 32], 16 channels x 4 inputs per 32 bytes, and float32 [N/16, K/G, 2, 16], per
block of 16 channels and group their scales and biases -(zero + 128) * scale. `linear` multiplies bf16 activations
by them on a CPU with AMX-BF16: up to 2 rows by AVX-512 BF16 dot products, up to 64 on AMX tiles, more in slices
of 64 rows. What it does not cover (another dtype or device, a width that is not a multiple of 32 inputs and 16
outputs, a group that is not a multiple of 32) is left to the caller (None). `awq_tensors` reads the layout back
(the dequantized reference, and torch's int4 layout for float32 activations). Measured in scripts/bench_quant.py
--kernels.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_gemm import NativeGemm, address, enabled, load_amx_library
from kernels.native_build import CSRC

SOURCE = CSRC / "awq_gemm_cpu.c"
MAX_ROWS = 64  # the kernel's rows per call; more go in slices
BLOCK_N, BLOCK_K = 16, 32

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


def load() -> ctypes.CDLL | None:
    """The kernel built for this CPU, with the AMX state granted; None where it cannot run (or the kernels are
    switched off: kernels/cpu_gemm.py `set_enabled`)."""
    return _load() if enabled() else None


@functools.cache
def _load() -> ctypes.CDLL | None:
    gemm = [_ptr] * 4 + [_i64] * 4 + [ctypes.c_int]
    return load_amx_library(SOURCE, "AWQ int4 matmuls", "awq_gemm_init", {"awq_gemm": gemm})


def fits(out_features: int, in_features: int, group: int) -> bool:
    """Whether a layer of these widths and group size has the kernel's shape."""
    return (
        out_features % BLOCK_N == 0 and in_features % BLOCK_K == 0 and group % BLOCK_K == 0 and in_features % group == 0
    )


def repack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's codes [K, N], zero points [K/G, N] (0..15, channel order) and scales [K/G, N] -> the kernel's codes
    uint8 [N/16, K/4, 32] and scales float32 [N/16, K/G, 2, 16] (per group the 16 channels' scales, then their
    biases -(zero + 128) * scale)."""
    k, n = codes.shape
    c = codes.t().to(torch.uint8).reshape(n // BLOCK_N, BLOCK_N, k // 4, 2, 2)  # [blocks, i, q, half, t]
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n // BLOCK_N, k // 4, 32)
    s = scales.t().float().reshape(n // BLOCK_N, BLOCK_N, -1).permute(0, 2, 1)  # [blocks, K/G, 16]
    z = zeros.t().float().reshape(n // BLOCK_N, BLOCK_N, -1).permute(0, 2, 1)
    return packed.contiguous(), torch.stack([s, -(z + 128) * s], dim=2).contiguous()


def awq_tensors(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`repack`'s inverse: codes int32 [K, N], zero points int32 [K/G, N] and scales float32 [K/G, N]."""
    blocks, quads, _ = packed.shape
    b = packed.reshape(blocks, quads, BLOCK_N, 2)
    c = torch.stack([b & 0xF, b >> 4], dim=3)  # [blocks, q, i, half, t]
    codes = c.permute(0, 2, 1, 3, 4).reshape(blocks * BLOCK_N, 4 * quads).t().int()
    s = scales[:, :, 0].permute(1, 0, 2).reshape(scales.shape[1], blocks * BLOCK_N)
    bias = scales[:, :, 1].permute(1, 0, 2).reshape(scales.shape[1], blocks * BLOCK_N)
    zeros = torch.where(s != 0, -bias / torch.where(s != 0, s, 1) - 128, 0).round().int()  # bias = -(z + 128) s
    return codes.contiguous(), zeros, s.contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [T, K] bf16 times the weight of `repack`'s layout, transposed: [T, N] bf16; None where the kernel does not
    cover them (the caller multiplies in torch). Called per projection per step: its checks are kept few and
    cheap (a one-sequence step makes 120 calls of tens of microseconds each)."""
    library = load()
    n, k, groups = packed.shape[0] * BLOCK_N, packed.shape[1] * 4, scales.shape[1]
    rows = x.shape[0] if x.dim() == 2 else 0
    if (
        library is None
        or rows < 1
        or x.dtype != torch.bfloat16
        or x.shape[1] != k
        or x.is_cuda
        or k % groups
        or (k // groups) % BLOCK_K
    ):
        return None
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    threads, group = torch.get_num_threads(), k // groups
    if rows <= MAX_ROWS:  # a decode step: one call
        status = library.awq_gemm(
            x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, n, k, group, threads
        )
        return out if status == 0 else None
    for first in range(0, rows, MAX_ROWS):
        status = library.awq_gemm(
            x[first].data_ptr(),
            packed.data_ptr(),
            scales.data_ptr(),
            out[first].data_ptr(),
            min(MAX_ROWS, rows - first),
            n,
            k,
            group,
            threads,
        )
        if status != 0:
            return None
    return out


def native_linear(packed: torch.Tensor, scales: torch.Tensor, rows: int) -> NativeGemm | None:
    """The one call `linear` makes for `rows` bf16 rows (at most `MAX_ROWS`); None where it would make none."""
    library = load()
    n, k, groups = packed.shape[0] * BLOCK_N, packed.shape[1] * 4, scales.shape[1]
    if library is None or not 0 < rows <= MAX_ROWS or packed.is_cuda or k % groups or (k // groups) % BLOCK_K:
        return None
    return NativeGemm(address(library, "awq_gemm"), 1, packed.data_ptr(), scales.data_ptr(), k // groups, n, k)
