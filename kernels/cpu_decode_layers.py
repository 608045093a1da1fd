"""Every decoder layer of a CPU decode step in one C call (kernels/csrc/decode_layers_cpu.c), loaded with ctypes.

The C side calls the kernels the Python path calls, through the function addresses it is given, in the same
order: a step's result is the Python path's bit for bit, without the host work between ~300 kernel calls. This
module holds the C structs as ctypes mirrors; worker_node/models/native_decode.py decides when a model and a step
qualify and fills them.
"""

from __future__ import annotations

import ctypes
import functools

from kernels.native_build import CFLAGS, CSRC, load_library

SOURCE = CSRC / "decode_layers_cpu.c"

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


class Gemm(ctypes.Structure):
    """kernels/cpu_gemm.py's `NativeGemm` as the C side reads it."""

    _fields_ = [
        ("fn", _ptr),
        ("kind", _i64),
        ("weight", _ptr),
        ("scales", _ptr),
        ("arg", _i64),
        ("n", _i64),
        ("k", _i64),
        ("gated", _i64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", Gemm),
        ("o", Gemm),
        ("gate_up", Gemm),
        ("down", Gemm),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
    ]


class Kernels(ctypes.Structure):
    _fields_ = [("norm", _ptr), ("rotary", _ptr), ("silu_mul", _ptr), ("write_kv", _ptr), ("attention", _ptr)]


class Step(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "rot", "inter")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, _ptr) for name in ("cos", "sin", "slots")),
        *((name, _i64) for name in ("num_slots", "block_size", "max_blocks")),
        *((name, _ptr) for name in ("block_tables", "seq_lens")),
        *((name, _ptr) for name in ("x", "residual", "delta", "h", "qkv", "q", "attn", "gate_up", "act")),
        ("threads", ctypes.c_int),
        ("phase_seconds", _ptr),
    ]


# What `Step.phase_seconds` adds up, per phase of a layer (the C source's PHASES, in order).
PHASES = ("input norm", "qkv", "rotary + KV write", "attention", "o", "post norm", "gate/up", "silu + down")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The runner, built first if needed; None where it cannot be built here."""
    library = load_library(SOURCE, CFLAGS, "the CPU decode-layers runner")
    if library is None:
        return None
    library.run_decode_layers.restype = ctypes.c_int
    library.run_decode_layers.argtypes = [ctypes.POINTER(Kernels), ctypes.POINTER(Layer), _i64, ctypes.POINTER(Step)]
    return library
