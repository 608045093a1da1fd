"""Weight-only matrix products on any x86/ARM CPU (kernels/csrc/portable_gemm_cpu.c): the codes widened in registers.

`linear(x, codes, scales)` is `F.linear(x, codes.to(x.dtype)) * scales` for float32 or bf16 activations x [T, K]
times int8 codes [N, K] with a float32 scale per output channel; `linear_int4(x, packed, pairs, group)` the same
for AWQ's 4-bit codes in `repack_int4`'s layout (a scale and zero point per channel and group). Neither converts
the codes in memory: each is read once per call of up to `CHUNK_ROWS` rows and widened to float32 in registers.
Portable C (GCC's vector extensions, -march=native): AVX2 vectors on Zen 3, AVX-512 on Zen 4, where the AMX
kernels of kernels/cpu_gemm.py and cpu_gemm_awq.py do not run. Batch-invariant: a row's result never depends on the
other rows of the call. What it does not cover (another device or dtype, K not a multiple of 16 or N of 8, more
than `MAX_ROWS` rows for int8, no C compiler) is left to the caller (None). Measured in scripts/bench_quant.py
--kernels (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import cpu_gemm
from kernels.cpu_gemm import NativeGemm, address
from kernels.native_build import CSRC, load_library

SOURCE = CSRC / "portable_gemm_cpu.c"
# Not -ffast-math: gcc must keep each sum's order (batch invariance; the same result at every row count).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC")
BLOCK_N, BLOCK_K = 8, 16
# Rows per int8 call, and AWQ's float32 rows per kernel call: beyond them (prefill) converting the codes once for
# torch's matmul is faster (docs/benchmarks.md)
MAX_ROWS = 64
ACTIVATIONS = {torch.float32: 0, torch.bfloat16: 1}

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


def load() -> ctypes.CDLL | None:
    """The kernel built for this CPU; None where it cannot be (no compiler) or the kernels are switched off
    (kernels/cpu_gemm.py `set_enabled`)."""
    return _load() if cpu_gemm.enabled() else None


@functools.cache
def _load() -> ctypes.CDLL | None:
    return build(FLAGS)


def build(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel built with these compiler flags, its entry typed (tests build other vector widths too)."""
    library = load_library(SOURCE, flags, "weight-only matmuls")
    if library is not None:
        library.int8_weight_gemm.restype = ctypes.c_int
        library.int8_weight_gemm.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 2
        library.int4_weight_gemm.restype = ctypes.c_int
        library.int4_weight_gemm.argtypes = [_ptr] * 4 + [_i64] * 4 + [ctypes.c_int] * 2
        library.int4_widen.restype = ctypes.c_int
        library.int4_widen.argtypes = [_ptr] * 3 + [_i64] * 3 + [ctypes.c_int]
        library.int4_chunk.restype = ctypes.c_int
        library.int4_chunk.argtypes = []
    return library


def covers(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel takes x [T, K] (float32 or bf16, 1 <= T <= MAX_ROWS) times these codes [N, K] and float32
    scales [N] on this machine."""
    return (
        x.device.type == "cpu"
        and x.dtype in ACTIVATIONS
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and codes.dtype == torch.int8
        and codes.device.type == "cpu"
        and codes.dim() == 2
        and codes.is_contiguous()
        and codes.shape[1] == x.shape[1]
        and codes.shape[0] % BLOCK_N == 0
        and codes.shape[1] % BLOCK_K == 0
        and scales.dtype == torch.float32
        and scales.shape == (codes.shape[0],)
        and scales.is_contiguous()
        and load() is not None
    )


def linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [T, K] times (codes [N, K] * scales [N, 1])^T: [T, N] in x's dtype; None where the kernel does not cover
    them (the caller multiplies in torch)."""
    if not covers(x, codes, scales):
        return None
    library = load()
    assert library is not None
    return multiply(library, x, codes, scales)


def multiply(library: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """`linear` in this build of the kernel, on inputs `covers` accepts."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], codes.shape[0], dtype=x.dtype)
    rows, outputs, inputs = x.shape[0], codes.shape[0], codes.shape[1]
    kind, threads = ACTIVATIONS[x.dtype], torch.get_num_threads()
    status = library.int8_weight_gemm(
        x.data_ptr(), codes.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, outputs, inputs, kind, threads
    )
    return out if status == 0 else None


def scores(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x times int8 codes scaled per output channel in a C kernel (an int8 LM head's logits): AMX-INT8 with bf16
    activations quantized per row where it runs (kernels/cpu_gemm.py; float32 out: the logits are not rounded to
    bf16 and converted back), else this kernel; None where neither covers them."""
    bf16 = x.dtype == torch.bfloat16
    out = cpu_gemm.linear_int8_act(x, codes, scales, out_dtype=torch.float32) if bf16 else None
    return out if out is not None else linear(x, codes, scales)


def int4_chunk(library: ctypes.CDLL | None = None) -> int | None:
    """Inputs per chunk of `repack_int4`'s layout in this build (2 vectors: 16 on AVX2, 32 on AVX-512); None where
    the kernel is not built."""
    library = library or load()
    return None if library is None else int(library.int4_chunk())


def fits_int4(out_features: int, in_features: int, group: int, library: ctypes.CDLL | None = None) -> bool:
    """Whether an AWQ layer of these widths and group size has the int4 product's shape on this machine."""
    chunk = int4_chunk(library)
    return chunk is not None and out_features % BLOCK_N == 0 and group % chunk == 0 and in_features % group == 0


def repack_int4(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's codes [K, N] (0..15), zero points and scales [K/G, N] -> the kernel's codes uint8 [N, K/2] (per chunk
    of `chunk` inputs, byte i holds input i in its low nibble and input chunk/2 + i in its high one) and float32
    pairs [N, K/G, 2]: (scale, -zero * scale)."""
    k, n = codes.shape
    c = codes.t().to(torch.uint8).reshape(n, k // chunk, 2, chunk // 2)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)
    s, z = scales.t().float(), zeros.t().float()
    return packed.contiguous(), torch.stack([s, -z * s], dim=-1).contiguous()


def linear_int4(
    x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, library: ctypes.CDLL | None = None
) -> torch.Tensor | None:
    """x [T, K] (float32 or bf16, any T) times `repack_int4`'s weight, transposed: [T, N] in x's dtype; None where
    the kernel does not take them (the caller multiplies in torch)."""
    library = library or load()
    if library is None or not _int4_layout(packed, pairs):
        return None
    n, k, groups = packed.shape[0], packed.shape[1] * 2, pairs.shape[1]
    if x.device.type != "cpu" or x.dtype not in ACTIVATIONS or x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != k:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    status = library.int4_weight_gemm(
        x.data_ptr(),
        packed.data_ptr(),
        pairs.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        n,
        k,
        k // groups,
        ACTIVATIONS[x.dtype],
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def native_int4(packed: torch.Tensor, pairs: torch.Tensor) -> NativeGemm | None:
    """The call `linear_int4` makes for bf16 rows (any count), for kernels/csrc/decode_layers_cpu.c (its kind 2:
    the int4 entry with bf16 activations); None where it would make none."""
    library = load()
    if library is None or not _int4_layout(packed, pairs):
        return None
    n, k, groups = packed.shape[0], packed.shape[1] * 2, pairs.shape[1]
    return NativeGemm(address(library, "int4_weight_gemm"), 2, packed.data_ptr(), pairs.data_ptr(), k // groups, n, k)


def widen_int4(packed: torch.Tensor, pairs: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """The float32 weight [N, K] that `linear_int4` multiplies by (the same numbers), for torch's matmul where it is
    faster; None where the kernel is not built or refuses the shapes."""
    library = library or load()
    if library is None or not _int4_layout(packed, pairs):
        return None
    n, k, groups = packed.shape[0], packed.shape[1] * 2, pairs.shape[1]
    out = torch.empty(n, k)
    status = library.int4_widen(
        packed.data_ptr(),
        pairs.data_ptr(),
        out.data_ptr(),
        n,
        k,
        k // groups,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def _int4_layout(packed: torch.Tensor, pairs: torch.Tensor) -> bool:
    """Whether these are `repack_int4`'s tensors as the kernel reads them: CPU, contiguous, of matching shapes, the
    inputs split into whole groups."""
    return (
        packed.dim() == 2
        and pairs.dim() == 3
        and pairs.shape[1] > 0
        and (packed.shape[1] * 2) % pairs.shape[1] == 0
        and packed.device.type == "cpu"
        and packed.dtype == torch.uint8
        and packed.is_contiguous()
        and pairs.device.type == "cpu"
        and pairs.dtype == torch.float32
        and pairs.shape[::2] == (packed.shape[0], 2)
        and pairs.is_contiguous()
    )
