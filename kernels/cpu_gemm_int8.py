"""int8 weight-only matrix products on any x86/ARM CPU (kernels/csrc/int8_gemm_cpu.c): the codes widened in registers.

`linear(x, codes, scales)` is `F.linear(x, codes.to(x.dtype)) * scales` for float32 or bf16 activations x [T, K]
times int8 codes [N, K] with a float32 scale per output channel, without converting the codes in memory: each
code is read once per call of up to `CHUNK_ROWS` rows and widened to float32 in registers. Portable C (GCC's
vector extensions, -march=native): AVX2 vectors on this project's Zen 3, AVX-512 on Zen 4, where the AMX kernels
of kernels/cpu_gemm.py do not run. Batch-invariant: a row's result never depends on the other rows of the call.
What it does not cover (another device or dtype, K not a multiple of 16 or N of 8, more than `MAX_ROWS` rows,
no C compiler) is left to the caller (None). Measured in scripts/bench_quant.py --kernels (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels import cpu_gemm
from kernels.native_build import CSRC, load_library

SOURCE = CSRC / "int8_gemm_cpu.c"
# Not -ffast-math: gcc must keep each sum's order (batch invariance; the same result at every row count).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC")
BLOCK_N, BLOCK_K = 8, 16
MAX_ROWS = 64  # beyond it (prefill) converting the codes once for torch's matmul is faster: docs/benchmarks.md
ACTIVATIONS = {torch.float32: 0, torch.bfloat16: 1}

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel built for this CPU; None where it cannot be (no compiler) or $MINIVLLM_CPU_GEMM is 0."""
    if os.environ.get(cpu_gemm.DISABLE_ENV) == "0":
        return None
    return build(FLAGS)


def build(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel built with these compiler flags, its entry typed (tests build other vector widths too)."""
    library = load_library(SOURCE, flags, "int8 weight-only matmuls")
    if library is not None:
        library.int8_weight_gemm.restype = ctypes.c_int
        library.int8_weight_gemm.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 2
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
    activations quantized per row where it runs (kernels/cpu_gemm.py), else this kernel; None where neither
    covers them."""
    out = cpu_gemm.linear_int8_act(x, codes, scales) if x.dtype == torch.bfloat16 else None
    return out if out is not None else linear(x, codes, scales)
