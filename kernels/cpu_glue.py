"""A decoder layer's element-wise glue on CPU in one pass each (kernels/csrc/glue_cpu.c, loaded with ctypes):
residual add + RMSNorm, rotary on q and k together, silu(gate) * up, the new tokens' K/V into their cache slots.

Each function takes the torch path where the C one does not apply (no C compiler, not on the CPU, a dtype other
than float32 / bfloat16, layouts the kernel does not read) and returns what that path returns, within float32's
rounding (bf16: the kernel rounds once where torch's chain of bf16 ops rounds after each).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels import torch_attention
from kernels.native_build import CFLAGS, CSRC, load_library

SOURCE = CSRC / "glue_cpu.c"

# The element types the kernel is built for (-DELEMENT, the values of the C source's ELEMENT_* names).
ELEMENTS = {torch.float32: 0, torch.bfloat16: 1}

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_int = ctypes.c_int
_f32 = ctypes.c_float


@functools.cache
def load(dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The kernels built for `dtype` elements (building them first if needed); None where they cannot be built."""
    library = load_library(SOURCE, (*CFLAGS, f"-DELEMENT={ELEMENTS[dtype]}"), "the CPU layer glue")
    if library is None:
        return None
    signatures = {
        "add_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32, _f32, _int],
        "add_rms_norm_f32": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32, _f32, _int],
        "rotary": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _int],
        "silu_mul": [_ptr, _ptr, _i64, _i64, _int],
        "write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    }
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = ctypes.c_int if name == "write_kv" else None
        function.argtypes = argtypes
    return library


def _library(x: torch.Tensor, *others: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels for x's dtype when x is on the CPU, that dtype has a build and `others` share it."""
    if x.device.type != "cpu" or x.dtype not in ELEMENTS or any(t.dtype != x.dtype for t in others):
        return None
    return load(x.dtype)


def _rows(x: torch.Tensor, width: int) -> bool:
    """[rows, width] with contiguous rows (the rows themselves may lie apart, as in a view of wider rows)."""
    return x.dim() == 2 and x.shape[1] == width and x.stride(1) == 1


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta): the RMSNorm scaled by `offset + weight`, computed in float32 and rounded
    once to the weight's dtype, and the residual it normed (x itself when `delta` is None, else a new tensor in
    x's dtype). x may be a 16-bit model's float32 residual stream, delta and weight in the model's dtype: the sum
    is then float32, unrounded."""
    width = x.shape[-1]
    if x.dim() != 2 and delta is None:  # per-head norms (Qwen3's q and k): one row per head
        return rms_norm(x.reshape(-1, width), weight, eps, offset)[0].view(x.shape), x
    wide = x.dtype == torch.float32 and weight.dtype != torch.float32  # a float32 residual stream
    library = _library(weight) if wide else _library(x, weight)
    if delta is not None and (delta.dtype != weight.dtype or delta.shape != x.shape or delta.stride(1) != 1):
        library = None
    if library is None or not _rows(x, width) or not weight.is_contiguous():
        return _torch_rms_norm(x, weight, eps, offset, delta)
    out = torch.empty(x.shape, dtype=weight.dtype)
    residual = x if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    entry = library.add_rms_norm_f32 if wide else library.add_rms_norm
    entry(
        x.data_ptr(),
        x.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        None if delta is None else residual.data_ptr(),
        x.shape[0],
        width,
        eps,
        offset,
        torch.get_num_threads(),
    )
    return out, residual


def _torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, delta: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        x = x + delta.to(x.dtype)
    if not offset and x.dtype == weight.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (offset + weight.float())).to(weight.dtype), x


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos / sin [T, 1, rot] (in their dtype): the first `rot`
    dims of each head, in NeoX's halves layout. False (nothing done) where the kernel does not apply."""
    library = _library(q, k, cos, sin)
    if library is None or q.dim() != 3 or k.dim() != 3 or q.shape[-1] != k.shape[-1]:
        return False
    tokens, head_dim, rot = q.shape[0], q.shape[-1], cos.shape[-1]
    heads_contiguous = all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k))
    if not heads_contiguous or not cos.is_contiguous() or not sin.is_contiguous() or k.shape[0] != tokens:
        return False
    if cos.numel() != tokens * rot or sin.shape != cos.shape or rot % 2 or rot > head_dim:
        return False
    library.rotary(
        q.data_ptr(),
        q.stride(0),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        head_dim,
        rot,
        torch.get_num_threads(),
    )
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [..., 2 * I] rows holding gate then up."""
    library = _library(gate_up)
    width = gate_up.shape[-1] // 2
    if library is None or not gate_up.is_contiguous():
        gate, up = gate_up.split(width, dim=-1)
        return F.silu(gate) * up
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype)
    library.silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() // max(width, 1), width, torch.get_num_threads())
    return out


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """`kernels.torch_attention.write_kv`: the new tokens' keys and values into their cache slots, copied in C
    where the cache holds them as they are (float32 or bf16, the rows' own dtype, each token's heads contiguous);
    a quantized cache, or anything else, goes to torch."""
    library = _library(key, value, k_cache, v_cache)
    width = k_cache.shape[2] * k_cache.shape[3] if k_cache.dim() == 4 else 0
    if (
        library is None
        or k_scales is not None
        or v_scales is not None
        or not all(_heads_in_rows(t, width) for t in (key, value))
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape)
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or slot_mapping.shape != key.shape[:1]
    ):
        torch_attention.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    status = library.write_kv(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        width,
        num_slots,
    )
    if status != 0:
        raise IndexError(f"write_kv: a slot of {slot_mapping.tolist()} is outside the cache's {num_slots} slots")


def _heads_in_rows(x: torch.Tensor, width: int) -> bool:
    """[T, H, D] whose H x D elements of each token are contiguous (`width` of them); tokens may lie apart."""
    return x.dim() == 3 and x.shape[1] * x.shape[2] == width and x.stride(2) == 1 and x.stride(1) == x.shape[2]
