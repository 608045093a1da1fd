"""Skinny matrix products on CPU: decode steps' `x @ w.T` on AMX tiles (kernels/csrc/skinny_gemm_cpu.c), or with
AVX-512 BF16 or AVX2 vectors where there is no AMX (kernels/csrc/vector_gemm_cpu.c: the same entries; which one,
kernels/cpu_isa.py).

`linear(x, weight, bias)` is `F.linear` for every input; on a CPU with AMX-BF16 (or AVX-512 BF16, or AVX2) it
multiplies bf16 activations of
at most `MAX_ROWS` rows by a bf16 weight, or by int8 codes with a float32 scale per output channel
(`linear_int8`), in the C kernel, reading the weight once from the layout torch keeps (no repacked copy). What it
does not cover (another device or dtype, more rows, a width that is not a multiple of 32 inputs and 16 outputs)
goes to torch. `linear_int8_act` multiplies int8 codes by the activations quantized per row in the call (8 or 16
bits; any row count; AMX-INT8, inputs a multiple of 64). Measured against torch on SmolLM2's shapes in
scripts/bench_quant.py --kernels (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_isa
from kernels.cpu_features import cpu_flags_line
from kernels.native_build import CFLAGS, CSRC, load_library
from settings.fast_paths import ACT_BITS  # what the int8 kernel quantizes activations to

SOURCE = CSRC / "skinny_gemm_cpu.c"
VECTOR_SOURCE = CSRC / "vector_gemm_cpu.c"  # the same entries without AMX (kernels/cpu_isa.py picks)
VECTOR_BUILDS = {"avx2": 1, "avx512_bf16": 2}  # what its `vector_gemm_isa` returns in each build
MAX_ROWS = 64  # the kernel's limit (four accumulator tiles of 16 rows); above it torch's matmul is as fast
BLOCK_N, BLOCK_K = 16, 32
WEIGHT_FORMATS = {torch.bfloat16: 0, torch.int8: 1}
VECTOR_FORMATS = {**WEIGHT_FORMATS, torch.float8_e4m3fn: 2}  # fp8 (e4m3) codes: vector_gemm_cpu.c only
NEEDED_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
INT8_FLAG = "amx_int8"  # for `linear_int8_act` (every CPU with AMX-BF16 so far has it too)
QUADS_K = 64  # inputs per int8 tile product
INVARIANT_ROWS = 16  # batch-invariant mode: torch multiplies every call in chunks of exactly this many rows

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


# Whether the C matmul kernels (this one, kernels/cpu_gemm_portable.py, kernels/cpu_gemm_awq.py) may be used: a
# worker's --cpu-gemm (settings/fast_paths.py), set as a rank loads (worker_node/loading.py). A module-level switch,
# not an argument: the kernels are asked for deep in the layers' weight packing and products.
_enabled = [True]


def set_enabled(on: bool) -> None:
    """Turn the C matmul kernels on or off (off: torch's matmuls only, to compare), for what is loaded next."""
    _enabled[0] = on


def enabled() -> bool:
    return _enabled[0]


def load_amx_library(source: Path, what: str, init: str, entries: dict[str, list[Any]]) -> ctypes.CDLL | None:
    """A kernel of kernels/csrc on AMX tiles, built for this CPU, its `entries` typed (each returns an int) and its
    `init` run (which asks Linux for the AMX state); None where it cannot run here."""
    if cpu_isa.current() != "amx" or not NEEDED_FLAGS <= set(cpu_flags_line().partition(":")[2].split()):
        return None
    library = load_library(source, CFLAGS, what)
    if library is None:
        return None
    for name, argtypes in {init: [], **entries}.items():
        getattr(library, name).restype = ctypes.c_int
        if argtypes:
            getattr(library, name).argtypes = argtypes
    return library if getattr(library, init)() else None


def load() -> ctypes.CDLL | None:
    """The kernel built for this CPU's instruction set (kernels/cpu_isa.py: AMX, with the AMX state granted to
    this process, or the AVX-512 BF16 or AVX2 build of the vector kernel); None where none can run (or the kernels
    are switched off)."""
    return _load(cpu_isa.current()) if enabled() else None


_GEMM_ARGS = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 2


@functools.cache
def _load(isa: str | None) -> ctypes.CDLL | None:
    if isa in VECTOR_BUILDS:
        return load_vector(isa)
    names = ("skinny_gemm", "skinny_gemm_f32", "int8_gemm", "int8_gemm_f32", "int8_gemm_silu_gated")
    entries = {name: _GEMM_ARGS for name in names}
    return load_amx_library(SOURCE, "CPU decode matmuls", "skinny_gemm_init", entries) if isa == "amx" else None


@functools.cache
def load_vector(isa: str) -> ctypes.CDLL | None:
    """vector_gemm_cpu.c built for `isa` ("avx512_bf16" or "avx2"), whatever was chosen (tests build each the CPU
    has); None where this CPU lacks the set or it cannot be built."""
    if not cpu_isa.has(isa):
        return None
    library = load_library(VECTOR_SOURCE, cpu_isa.VECTOR_FLAGS[isa], f"CPU decode matmuls ({isa})")
    if library is None:
        return None
    for name in ("skinny_gemm", "skinny_gemm_f32", "vector_gemm_isa"):
        getattr(library, name).restype = ctypes.c_int
    library.skinny_gemm.argtypes = library.skinny_gemm_f32.argtypes = _GEMM_ARGS
    return library if library.vector_gemm_isa() == VECTOR_BUILDS[isa] else None


class NativeGemm(NamedTuple):
    """A projection of bf16 rows as one kernel call, what kernels/csrc/decode_layers_cpu.c's `Gemm` holds: the
    function's address, its signature (`kind`: 0, a last int argument; 1, an int64 one; 2, the portable int4
    entry's), the weight's and scales' addresses, that last argument and the widths. `gated`: the kernel takes a
    gated MLP's [T, 2K] gate/up rows."""

    fn: int
    kind: int
    weight: int
    scales: int
    arg: int
    n: int
    k: int
    gated: bool = False


def address(library: ctypes.CDLL, name: str) -> int:
    """A loaded kernel's function address (for a C caller)."""
    value = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    assert value is not None
    return value


def covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x [T, K] times this weight [N, K] (bf16 or int8), on this CPU."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[1] == weight.shape[-1]
        and covers_weight(x.shape[0], weight)
    )


def covers_weight(rows: int, weight: torch.Tensor) -> bool:
    """Whether the kernel takes `rows` bf16 rows times this weight [N, K] (bf16 or int8), on this CPU."""
    return (
        0 < rows <= MAX_ROWS
        and weight.dtype in weight_formats()
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % BLOCK_N == 0
        and weight.shape[1] % BLOCK_K == 0
        and weight.is_contiguous()
        and load() is not None
    )


def weight_formats() -> dict[torch.dtype, int]:
    """The weight dtypes the kernel chosen here multiplies, each with its number in the C entries."""
    return VECTOR_FORMATS if cpu_isa.current() in VECTOR_BUILDS else WEIGHT_FORMATS


def _run(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor | None:
    library = load()
    assert library is not None
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
    scale_pointer = None if scales is None else scales.data_ptr()
    rows, outputs, inputs = x.shape[0], weight.shape[0], weight.shape[1]
    threads = kernel_threads(rows)
    fmt = weight_formats()[weight.dtype]
    entry = library.skinny_gemm_f32 if out_dtype == torch.float32 else library.skinny_gemm
    status = entry(x.data_ptr(), weight.data_ptr(), scale_pointer, out.data_ptr(), rows, outputs, inputs, fmt, threads)
    return out if status == 0 else None


def kernel_threads(rows: int) -> int:
    """Threads for one product of `rows` rows."""
    return torch.get_num_threads()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = False
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, in the kernel where it covers x and weight (bf16 both).

    `invariant`: batch-invariant, each row's result depends on that row's values only, never on how many rows
    share the call. torch's CPU matmul picks its algorithm by row count (one row: a gemv; a few, or many: other
    blockings, which sum in other orders), so without it a sequence's logits move by ~1e-6 whenever what shares
    its batch changes: enough to flip a seeded draw that lies near a boundary of its distribution's CDF. The
    AMX kernel is invariant by construction (each output channel sums its 32-input blocks in order, whatever
    the rows; threads split the channels): it takes `MAX_ROWS` rows at a time; torch takes calls of exactly
    `INVARIANT_ROWS` rows, the last padded with zeros."""
    if weight.dtype == torch.bfloat16 and covers(x[:MAX_ROWS] if invariant else x, weight):
        out = _run(x, weight, None) if x.shape[0] <= MAX_ROWS else _run_chunks(x, weight)
        if out is not None:
            return out if bias is None else out + bias
    if invariant and x.dim() == 2 and 0 < x.shape[0] != INVARIANT_ROWS:
        return _padded_chunks(x, weight, bias)
    return F.linear(x, weight, bias)


def scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T (bf16 both) with float32 results, the sums unrounded: an LM head's logits, whose near-ties
    bf16's rounding would settle by token id. None where the kernel does not cover them."""
    if weight.dtype != torch.bfloat16 or not covers(x[:MAX_ROWS], weight):
        return None
    return _run_chunks(x, weight, torch.float32)


def _run_chunks(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """The kernel's product of any rows, `MAX_ROWS` at a time."""
    if x.shape[0] <= MAX_ROWS:
        return _run(x, weight, None, out_dtype)
    parts = []
    for chunk in x.split(MAX_ROWS):
        part = _run(chunk, weight, None, out_dtype)
        if part is None:
            return None
        parts.append(part)
    return torch.cat(parts)


def _padded_chunks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's product in calls of exactly `INVARIANT_ROWS` rows (the last padded with zeros): torch's result for
    a row depends on the call's row count, not on the row's place in it nor on the other rows."""
    rows = x.shape[0]
    padded = -(-rows // INVARIANT_ROWS) * INVARIANT_ROWS
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in x.split(INVARIANT_ROWS)])
    return out[:rows]


def linear_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [T, K] bf16 times int8 codes [N, K] (or fp8 e4m3 ones, where `weight_formats` has them) scaled per output
    channel (float32 scales [N]): [T, N] bf16; None where the kernel does not cover them (the caller multiplies in
    torch)."""
    if codes.dtype == torch.bfloat16:
        return None
    if not covers(x, codes) or scales.dtype != torch.float32 or not scales.is_contiguous():
        return None
    return _run(x, codes, scales)


def has_int8() -> bool:
    """Whether `linear_int8_act` can run here (the AMX kernel loads and the CPU has AMX-INT8)."""
    return _has_int8(cpu_isa.current()) if enabled() else False


@functools.cache
def _has_int8(isa: str | None) -> bool:
    return isa == "amx" and _load(isa) is not None and INT8_FLAG in cpu_flags_line().partition(":")[2].split()


def linear_int8_act(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    act_bits: int = 16,
    silu_gated: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor | None:
    """x [T, K] bf16 quantized per row to `act_bits` (8: W8A8; 16: two int8 halves, about bf16's precision)
    times int8 codes [N, K] scaled per output channel (float32 [N]): [T, N] bf16, any T; None where the kernel
    does not cover them (K not a multiple of 64, no AMX-INT8: the caller uses another path). `silu_gated`: x is
    a gated MLP's [T, 2K] (gate, then up) and the product takes silu(gate) * up, made as the rows are quantized
    (in float32, without the bf16 rounding of torch's two steps). `out_dtype` float32: the sums unrounded (an LM
    head's logits; not with `silu_gated`)."""
    if act_bits not in ACT_BITS:
        raise ValueError(f"act_bits must be one of {ACT_BITS}, not {act_bits}")
    if not (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[0] > 0
        and codes.dim() == 2
        and codes.shape[1] * (2 if silu_gated else 1) == x.shape[1]
        and covers_int8_act(codes, scales)
        and out_dtype in (torch.bfloat16, torch.float32)
        and not (silu_gated and out_dtype == torch.float32)
    ):
        return None
    library = load()
    assert library is not None
    x = x.contiguous()
    out = torch.empty(x.shape[0], codes.shape[0], dtype=out_dtype)
    if out_dtype == torch.float32:
        entry = library.int8_gemm_f32
    else:
        entry = library.int8_gemm_silu_gated if silu_gated else library.int8_gemm
    status = entry(
        x.data_ptr(),
        codes.data_ptr(),
        scales.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        codes.shape[0],
        codes.shape[1],
        act_bits,
        kernel_threads(x.shape[0]),
    )
    return out if status == 0 else None


def covers_int8_act(codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether `linear_int8_act` takes these int8 codes [N, K] and float32 scales [N] (for any bf16 rows)."""
    return (
        codes.dtype == torch.int8
        and codes.device.type == "cpu"
        and codes.dim() == 2
        and codes.is_contiguous()
        and codes.shape[0] % BLOCK_N == 0
        and codes.shape[1] % QUADS_K == 0
        and scales.dtype == torch.float32
        and scales.is_contiguous()
        and has_int8()
    )


def native_linear(weight: torch.Tensor, rows: int, scales: torch.Tensor | None = None) -> NativeGemm | None:
    """The call `linear` (bf16 weight) or `linear_int8` (int8 or fp8 codes, float32 scales) makes for `rows` rows;
    None where they would not call the kernel."""
    if not covers_weight(rows, weight) or (weight.dtype != torch.bfloat16) != (scales is not None):
        return None
    if scales is not None and (scales.dtype != torch.float32 or not scales.is_contiguous()):
        return None
    library = load()
    assert library is not None
    n, k = weight.shape
    scale_pointer = 0 if scales is None else scales.data_ptr()
    fmt = weight_formats()[weight.dtype]
    return NativeGemm(address(library, "skinny_gemm"), 0, weight.data_ptr(), scale_pointer, fmt, n, k)


def native_int8_act(
    codes: torch.Tensor, scales: torch.Tensor, act_bits: int, silu_gated: bool = False
) -> NativeGemm | None:
    """The call `linear_int8_act` makes (any rows); None where it would not call the kernel."""
    if act_bits not in ACT_BITS or not covers_int8_act(codes, scales):
        return None
    library = load()
    assert library is not None
    name = "int8_gemm_silu_gated" if silu_gated else "int8_gemm"
    n, k = codes.shape
    return NativeGemm(address(library, name), 0, codes.data_ptr(), scales.data_ptr(), act_bits, n, k, silu_gated)
