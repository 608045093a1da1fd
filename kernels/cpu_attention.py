"""Paged decode attention compiled for this CPU (kernels/csrc/paged_attention_cpu.c), loaded with ctypes.

Built once per source, compiler flags, head shape, cache format and CPU feature set (kernels/native_build.py), so a
worker starts in milliseconds after the first build. Where no C compiler is found, `load()` returns None and the
worker keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kernels.interface import DecodeAttention
from kernels.kv_quant import SCALE_DTYPE, is_quantized
from kernels.native_build import CFLAGS, CSRC, VECTOR_WIDTH, load_library

SOURCE = CSRC / "paged_attention_cpu.c"

MAX_GROUP = 16  # query heads per kv head the kernel is built for, at most
MAX_HEAD_DIM = 256

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


# The cache dtypes the kernel reads, each its own build (-DKV_FORMAT, the values of the C source's KV_* names).
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}


@functools.cache
def load(head_dim: int = 64, group: int = 1, kv_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The kernel compiled for this head size, query heads per kv head and cache dtype (float32, bfloat16, or
    int8 / float8_e4m3fn with scales), building it first if needed; None when it cannot be built here (logged
    once)."""
    shape = (f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", f"-DKV_FORMAT={KV_FORMATS[kv_dtype]}")
    flags = (*CFLAGS, VECTOR_WIDTH, *shape)
    library = load_library(SOURCE, flags, "CPU decode attention")
    if library is None:
        return None
    library.paged_decode_attention.restype = None
    library.paged_decode_attention.argtypes = (
        [_ptr] * 8 + [_i64] * 4 + [ctypes.c_float, ctypes.c_int, _i64, ctypes.c_float, ctypes.c_int]
    )
    library.paged_attention_limits.restype = ctypes.c_int
    library.paged_attention_limits.argtypes = [_i64] * 2
    return library


@dataclass(frozen=True, slots=True)
class NativePlan:
    """A step's decode tables as the kernel reads them (int32, contiguous): made once, read by every layer."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> NativePlan:
    """The backend's `plan_decode` (kernels/interface.py): the tables converted once per step, not per layer."""
    return NativePlan(block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous())


class NativeDecodeAttention:
    """`paged_decode_attention` with the signature of `kernels.torch_attention.paged_decode_attention`.

    The cache may be float32 or bfloat16 (read as it is, accumulated in float32), or int8 / float8_e4m3fn with
    its float32 scales; bf16 queries go in as they are (others as float32), the output comes back in their
    dtype. Shapes or dtypes the kernel does not cover (caches of another dtype or not contiguous, not on the CPU,
    more than 16 query heads per kv head, heads wider than 256) go to `fallback`; sliding windows and soft-caps
    run in the kernel.
    """

    def __init__(self, fallback: DecodeAttention) -> None:
        self._fallback = fallback

    def library(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, ...]
    ) -> ctypes.CDLL | None:
        """The C library that runs these queries over these caches; None when the kernel does not cover them (the
        native decode runner, worker_node/models/native_decode.py, asks before it runs a step in C)."""
        caches = (k_cache, v_cache)
        if q.device.type != "cpu" or not q.is_floating_point():
            return None
        if any(t.device.type != "cpu" or t.dtype not in KV_FORMATS or not t.is_contiguous() for t in caches):
            return None
        if k_cache.dtype != v_cache.dtype or len(scales) != 2 * is_quantized(k_cache.dtype):
            return None
        if any(t.dtype != SCALE_DTYPE or t.shape != k_cache.shape[:3] or not t.is_contiguous() for t in scales):
            return None
        group, head_dim = q.shape[1] // k_cache.shape[2], q.shape[2]
        if group > MAX_GROUP or head_dim > MAX_HEAD_DIM:
            return None
        library = load(head_dim, group, k_cache.dtype)
        if library is None or not library.paged_attention_limits(k_cache.shape[2], k_cache.shape[1]):
            return None
        return library

    def __call__(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        seq_lens: torch.Tensor,  # [B] int32
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        k_scales: torch.Tensor | None = None,  # [N, block_size, Hkv] float32: a quantized cache's scales
        v_scales: torch.Tensor | None = None,
        plan: NativePlan | None = None,  # plan_decode of these tables (the fallback makes its own)
    ) -> torch.Tensor:
        scales = tuple(t for t in (k_scales, v_scales) if t is not None)
        library = self.library(q, k_cache, v_cache, scales)
        if library is None:
            options = {"k_scales": k_scales, "v_scales": v_scales} if scales else {}
            return self._fallback(
                q, k_cache, v_cache, block_tables, seq_lens, scale, window=window, softcap=softcap, **options
            )
        if plan is None:
            plan = plan_decode(block_tables, seq_lens, k_cache.shape[1])
        bf16_io = q.dtype == torch.bfloat16  # the kernel widens q and rounds its output itself
        query = (q if bf16_io else q.to(torch.float32)).contiguous()  # [B, H, D] is small: widened once
        out = torch.empty_like(query)
        scale_pointers: list[int | None] = [t.data_ptr() for t in scales] or [None, None]  # NULL: full precision
        library.paged_decode_attention(
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            *scale_pointers,
            plan.block_tables.data_ptr(),
            plan.seq_lens.data_ptr(),
            out.data_ptr(),
            q.shape[0],
            k_cache.shape[2],
            k_cache.shape[1],
            plan.block_tables.shape[1],
            scale,
            torch.get_num_threads(),
            window,
            softcap,
            bf16_io,
        )
        return out if bf16_io else out.to(q.dtype)
