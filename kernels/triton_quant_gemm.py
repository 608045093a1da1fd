"""Triton GEMMs over quantized weights, dequantized in registers: x [M, K] times a weight kept as 4-bit AWQ codes or
int8 rows, out [M, N] in x's dtype. The GPU path of worker_node/models/quant_awq.py and quant_int8.py; the torch
references are kernels/torch_quant_gemm.py's (the same arguments).

- AWQ (AutoAWQ's GEMM layout, read as the checkpoint stores it: no repacking): `qweight` int32 [K, N / 8], eight
  4-bit codes a word, nibble i holding output channel 8c + AWQ_ORDER[i] of packed column c; `qzeros` int32
  [K / G, N / 8] packed the same way; `scales` float16 [K / G, N]. A tile of K rows lies inside one group (BLOCK_K
  divides G), so each tile reads one row of zero points and scales. Each weight becomes (code - zero) * scale in
  float32, rounded to x's dtype: the numbers the reference multiplies, so the two differ only in summation order.
- int8: `qweight` int8 [N, K], one float scale per output channel applied to the float32 sum (x @ (q * s)^T ==
  (x @ q^T) * s, codes exact in bf16).

Decode multiplies a few rows by a weight of a few thousand columns: too few output tiles to fill a GPU, so the K
loop is split over `split_k` programs writing float32 partial sums, added in one torch sum (in a fixed order: the
same inputs give the same bits). Importing this module imports triton.
"""

# Triton spells compile-time constants (tl.constexpr arguments) in upper case.
# ruff: noqa: N803

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.torch_quant_gemm import PACK
from kernels.triton_common import multiprocessor_count

FORMATS = {"awq": 0, "int8": 1}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _awq_nibble_shift(cols):
    """Bit offset of output channel `cols` inside its packed word: AutoAWQ puts channel c of a word's eight in
    nibble (c // 2) + 4 * (c % 2) (the inverse of AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7)."""
    c = cols % 8
    return ((c // 2) + 4 * (c % 2)) * 4


@triton.jit
def _widen8(words):
    """[..., C] -> [..., 8C], each word repeated in the eight places of the channels it packs."""
    return tl.interleave(tl.interleave(tl.interleave(words, words), tl.interleave(words, words)),
                         tl.interleave(tl.interleave(words, words), tl.interleave(words, words)))  # fmt: skip


@triton.jit
def _quant_gemm_kernel(
    x_ptr, w_ptr, zeros_ptr, scales_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_om, stride_os,
    GROUP: tl.constexpr, FORMAT: tl.constexpr, GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if FORMAT == 0:
        shifts = _awq_nibble_shift(cols)
        if GATHER:  # each word loaded once per channel it packs (the repeats hit the L1)
            packed_cols = cols // 8
            pmask = cmask
        else:  # each word loaded once and widened in registers to the eight channels it packs
            packed_cols = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
            pmask = packed_cols < N // 8
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_end
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], rmask[:, None] & kmask[None, :], 0.0)
        if FORMAT == 0:
            words = tl.load(w_ptr + ks[:, None].to(tl.int64) * (N // 8) + packed_cols[None, :],
                            kmask[:, None] & pmask[None, :], 0)  # fmt: skip
            group = k0 // GROUP
            zero_words = tl.load(zeros_ptr + group * (N // 8) + packed_cols, pmask, 0)
            if not GATHER:
                words = _widen8(words)
                zero_words = _widen8(zero_words)
            codes = (words >> shifts[None, :]) & 0xF
            scales = tl.load(scales_ptr + group * N + cols, cmask, 0.0).to(tl.float32)
            offsets = -((zero_words >> shifts) & 0xF).to(tl.float32) * scales
            # code * scale - zero * scale: one FMA, and exactly (code - zero) * scale (both products are exact)
            w = (codes.to(tl.float32) * scales[None, :] + offsets[None, :]).to(x.dtype)
        else:
            wmask = kmask[:, None] & cmask[None, :]
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], wmask, 0).to(x.dtype)
        # "ieee" keeps float32 inputs off TF32 (the reference's precision); 16-bit inputs ignore it
        acc += tl.dot(x, w, input_precision="ieee")
    if FORMAT == 1:
        acc = acc * tl.load(scales_ptr + cols, cmask, 0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), rmask[:, None] & cmask[None, :])


class Tiles(NamedTuple):
    """A launch's shape: rows, outputs and inputs per program's tile, warps, pipeline stages, and (AWQ) whether
    each packed word is loaded once per channel (`gather`) or once and widened in registers."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    gather: bool = False


def tiles(rows: int, group: int | None) -> Tiles:
    """The tiles for `rows` activations (`group`: AWQ's group size; None: int8), the fastest of
    `scripts/gpu_quant.py --sweep` on an H200 at a Llama-3-8B MLP's two shapes (docs/benchmarks.md): 16 rows (the
    smallest tl.dot) up to 16, 32 or 64 up to 64, 128 beyond; K tiles of 128 (AWQ: at most one group) in decode,
    64 in prefill; int8's outputs 128 to a tile, AWQ's 64 in decode (its widening costs registers)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    if rows > 64:
        return Tiles(block_m, 128, 64 if group is None else min(64, group))
    if group is None:
        return Tiles(block_m, 128, 128)
    return Tiles(block_m, 64, min(128, group))


def choose_split(device: torch.device, output_tiles: int, k_tiles: int) -> int:
    """How many programs share a tile's K loop: enough for about two programs per multiprocessor, each keeping at
    least four K tiles (a split shorter than that costs more in partial sums than it hides)."""
    want = max(1, (2 * multiprocessor_count(device)) // max(output_tiles, 1))
    return max(1, min(want, k_tiles // 4))


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    zeros: torch.Tensor | None,
    scales: torch.Tensor,
    n: int,
    group: int | None,
    fmt: str,
    split_k: int | None,
    tile: Tiles | None,
) -> torch.Tensor:
    m, k = x.shape
    if m == 0:  # no grid of zero programs
        return x.new_empty(0, n)
    tile = tile or tiles(m, group)
    block_m, block_n, block_k = tile.block_m, tile.block_n, tile.block_k
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = split_k if split_k is not None else choose_split(x.device, grid_m * grid_n, k_tiles)
    split = max(1, min(split, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    _quant_gemm_kernel[(grid_m, grid_n, split)](
        x, w, zeros if zeros is not None else scales, scales, out,
        m, n, k, k_per_split,
        x.stride(0), out.stride(1), out.stride(0),
        GROUP=group or block_k, FORMAT=FORMATS[fmt], GATHER=tile.gather,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


def _check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    split_k: int | None = None,
    tile: Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] times the AWQ weight (w[n, k] = (code[k, n] - zero[k // G, n]) * scale[k // G, n]): [M, N]."""
    k, packed = qweight.shape
    n = packed * PACK
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
    if group_size < 16 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"group_size must be a power of two >= 16 dividing K = {k}, got {group_size}")
    groups = k // group_size
    if qzeros.shape != (groups, packed) or scales.shape != (groups, n):
        raise ValueError(
            f"for qweight {tuple(qweight.shape)} and groups of {group_size}: qzeros must be {(groups, packed)} and "
            f"scales {(groups, n)}, got {tuple(qzeros.shape)} and {tuple(scales.shape)}"
        )
    if not (qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()):
        raise ValueError("qweight, qzeros and scales must be contiguous")
    if tile is not None and group_size % tile.block_k:
        raise ValueError(f"tile.block_k {tile.block_k} must divide group_size {group_size}")
    return _launch(_check_x(x, k), qweight, qzeros, scales, n, group_size, "awq", split_k, tile)


def int8_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    split_k: int | None = None,
    tile: Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] times the int8 weight (w[n, k] = q[n, k] * scale[n]): [M, N]."""
    n, k = qweight.shape
    if qweight.dtype != torch.int8 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int8 [N, K], got {qweight.dtype}")
    if scales.shape != (n,) or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous [{n}], got {tuple(scales.shape)}")
    return _launch(_check_x(x, k), qweight, None, scales, n, None, "int8", split_k, tile)
