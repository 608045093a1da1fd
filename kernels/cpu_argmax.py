"""Greedy sampling's argmax over logits rows, compiled for this CPU (kernels/csrc/argmax_cpu.c), loaded with ctypes.

Reads float32 or bfloat16 logits once, in place (rows shared by torch's threads when the matrix outgrows the cache:
at 256 x 49,152 float32, 4.4 ms on two threads against 8 ms on one, docs/benchmarks.md); the answer is
torch.argmax's (first maximum on ties, the first NaN of a row with one). Where no C compiler is found `load()`
returns None and `argmax_rows` answers None: the caller keeps its own path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.native_build import CSRC, load_library

SOURCE = CSRC / "argmax_cpu.c"
# Not the other kernels' -ffast-math: it would let the compiler assume no NaN, and a NaN row must answer its NaN.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
DTYPES = (torch.float32, torch.bfloat16)

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel, built first if needed; None when it cannot be built here (logged once)."""
    library = load_library(SOURCE, FLAGS, "greedy sampling's argmax")
    if library is None:
        return None
    library.argmax_rows.restype = _i64
    library.argmax_rows.argtypes = [_ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, ctypes.c_int]
    library.top_rows.restype = ctypes.c_int
    library.top_rows.argtypes = [_ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, _ptr, ctypes.c_int]
    library.rescore_rows.restype = ctypes.c_int
    library.rescore_rows.argtypes = [
        *(_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int),  # hidden, weight, rows, dim, vocab, bf16
        *(_ptr, ctypes.c_int, _ptr, _i64, ctypes.c_int),  # top, k, logits, stride, threads
    ]
    return library


def _library_for(logits: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels' library where they read `logits` as it is: a [rows, cols] float32 or bfloat16 CPU tensor whose
    rows are contiguous and do not overlap; None for any other tensor, or where the library cannot be built."""
    if logits.device.type != "cpu" or logits.dtype not in DTYPES or logits.dim() != 2:
        return None
    rows, cols = logits.shape
    if logits.stride(1) != 1 or (rows > 1 and logits.stride(0) < cols):
        return None
    return load()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax (int64 [rows]) of a [rows, cols] float32 or bfloat16 CPU tensor whose rows are contiguous;
    None for any other tensor, or where the kernel cannot be built."""
    found = checked_argmax_rows(logits)
    return None if found is None else found[0]


def checked_argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """`argmax_rows`, and how many rows' maximum is not finite (NaN, an infinity, or nothing but -inf)."""
    library = _library_for(logits)
    if library is None or not logits.shape[1]:
        return None
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    bf16 = int(logits.dtype == torch.bfloat16)
    threads = torch.get_num_threads()
    not_finite = library.argmax_rows(logits.data_ptr(), rows, cols, logits.stride(0), bf16, out.data_ptr(), threads)
    return out, not_finite


def top_rows(logits: torch.Tensor, k: int) -> torch.Tensor | None:
    """The indices of each row's k largest values (int64 [rows, k], in no particular order; of tied values, any) of
    a [rows, cols] float32 or bfloat16 CPU tensor with contiguous rows, cols a multiple of 256 and more than k
    chunks of 256, k <= 64; None for any other tensor, a row with a NaN (torch's topk ranks it first), or where
    the kernel cannot be built."""
    library = _library_for(logits)
    if library is None or not logits.shape[0]:
        return None
    rows, cols = logits.shape
    out = torch.empty(rows, k, dtype=torch.int64)
    bf16 = int(logits.dtype == torch.bfloat16)
    threads = torch.get_num_threads()
    status = library.top_rows(logits.data_ptr(), rows, cols, logits.stride(0), bf16, k, out.data_ptr(), threads)
    return out if status == 0 else None


def rescore_rows(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, top: torch.Tensor) -> bool:
    """logits[r, top[r, j]] = hidden[r] . weight[top[r, j]] in float32, in place, for float32 logits [rows, vocab]
    (contiguous rows), hidden [rows, dim] and weight [vocab, dim] both bfloat16 or both float32 (contiguous), top
    int64 [rows, k]: the LM head's rescoring without gathering the rows. False (nothing written) for other tensors,
    a candidate outside the vocab, or where the kernel cannot be built."""
    library = _library_for(logits)
    if (
        library is None
        or logits.dtype != torch.float32
        or hidden.dtype not in DTYPES
        or weight.dtype != hidden.dtype
        or top.dtype != torch.int64
        or top.dim() != 2
        or hidden.dim() != 2
        or weight.dim() != 2
        or top.shape[0] != logits.shape[0]
        or hidden.shape[0] != logits.shape[0]
        or hidden.shape[1] != weight.shape[1]
        or weight.shape[0] > logits.shape[1]
        or not (hidden.is_contiguous() and weight.is_contiguous() and top.is_contiguous())
        or any(t.device.type != "cpu" for t in (hidden, weight, top))
    ):
        return False
    rows, k = top.shape
    bf16 = int(hidden.dtype == torch.bfloat16)
    status = library.rescore_rows(
        hidden.data_ptr(), weight.data_ptr(), rows, hidden.shape[1], weight.shape[0], bf16, top.data_ptr(), k,
        logits.data_ptr(), logits.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    return status == 0
