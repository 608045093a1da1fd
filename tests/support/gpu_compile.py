"""Compile the Triton kernels over quantized KV caches for sm_90 (H100/H200) without a GPU, for
tests/kernels/test_triton_compile.py.

Run as `python -m tests.support.gpu_compile` with TRITON_INTERPRET unset (under the interpreter `triton.jit`
gives functions that cannot be lowered); prints one JSON object: "<kernel> <cache>" -> "ok", or the error.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton_decode import _decode_split_kernel
from kernels.triton_prefill import _prefill_kernel
from kernels.triton_write_kv import _write_kv_kernel

HOPPER = GPUTarget("cuda", 90, 32)
CACHES = {"int8": ("*i8", 127.0), "fp8_e4m3": ("*fp8e4nv", 448.0)}  # the quantized caches: the CPU tests' blind spot
INTEGER_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32"}
INTEGER_POINTERS |= {"cu_tiles_ptr": "*i32", "slot_ptr": "*i64"}


def signature(kernel: Any, cache: str) -> dict[str, str]:
    """Argument types as the launcher infers them from a bf16 model's tensors over a `cache` KV cache."""
    types = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            types[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr"):
            types[name] = CACHES[cache][0]
        elif name in INTEGER_POINTERS:
            types[name] = INTEGER_POINTERS[name]
        elif name.endswith("_scales_ptr") or name in ("m_ptr", "l_ptr"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*bf16"
        else:
            types[name] = "fp32" if name in ("qk_scale", "cap") else "i32"
    return types


def launches(cache: str) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each kernel with every branch a quantized cache takes (bf16 queries, head_dim 64, GQA 3, soft-cap, window,
    split decode); small tiles, which take the same branches and compile faster than the GPU's own."""
    write = {"NUM_KV_HEADS": 3, "HEADS_PAD": 4, "HEAD_DIM": 64, "QUANT": True, "QMAX": CACHES[cache][1]}
    decode = {"GROUP": 3, "GROUP_PAD": 16, "HEAD_DIM": 64, "BLOCK_SIZE": 16, "BLOCK_N": 16, "DIRECT": False}
    decode |= {"SOFTCAP": True, "QUANT": True}
    prefill = {"GROUP": 3, "HEAD_DIM": 64, "BLOCK_SIZE": 16, "BLOCK_M": 32, "BLOCK_N": 16, "SEQS_PAD": 4}
    prefill |= {"WINDOWED": True, "SOFTCAP": True, "QUANT": True}
    return {
        "write_kv": (_write_kv_kernel, write),
        "decode": (_decode_split_kernel, decode),
        "prefill": (_prefill_kernel, prefill),
    }


def main() -> int:
    results: dict[str, str | bool] = {}
    for cache in CACHES:
        for name, (kernel, constants) in launches(cache).items():
            try:
                source = ASTSource(kernel, signature(kernel, cache), constants)
                compiled = triton.compile(source, HOPPER, {"num_warps": 4, "num_stages": 1})
                ptx = compiled.asm["ptx"]
                results[f"{name} {cache}"] = "ok" if compiled.asm.get("cubin") else "no cubin"
                results[f"{name} {cache} converts to e4m3"] = "cvt.rn.satfinite.e4m3x2.f32" in ptx
            except Exception as error:  # reported, not raised: the test names every kernel that fails
                results[f"{name} {cache}"] = f"{type(error).__name__}: {error}"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
