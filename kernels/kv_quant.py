"""Quantized KV cache formats: int8 or fp8 (e4m3) values with one float32 scale per token and KV head.

Beside the values `[num_blocks, block_size, Hkv, D]` (kernels/torch_attention.py's layout) lives a scale tensor
`[num_blocks, block_size, Hkv]`, so one slot index addresses both. A token's head row x is stored as x / s
rounded to the format (int8: to the nearest integer, halves up; fp8: to the nearest e4m3 value) with
s = max|x| / QMAX, and read back as q * s. The format is the values' dtype, `torch.int8` or
`torch.float8_e4m3fn`; a cache of any other dtype is full precision and has no scales.

Why one scale per token rather than per block: a block is written over several steps (decode appends one token at
a time), and a token quantized on its own never changes once written, so nothing has to be re-read, re-rounded or
fixed from a block's first token. Per-token scales cost 4 bytes per token and head beside its D values (6 % of
an int8 row at D = 64); what a per-block scale would lose in accuracy instead is measured by
scripts/bench_kv_quant.py (docs/guide.md, "Quantized KV cache").

The kernels never dequantize a whole tile: int8 and e4m3 values are exact in bf16, fp16 and fp32, so a key's
scale multiplies its score (q . k_raw * s_k) and a value's scale the probability that weighs it (p * s_v).
"""

from __future__ import annotations

import torch

# --kv-cache-dtype names -> the dtype the values are stored in ("auto": the model's dtype, no scales).
FORMATS: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# --kv-cache-dtype names of a full-precision cache in a float other than the model's (an fp16 cache under a bf16
# model): worker_node/models/attention.py casts K/V into it when they are written and queries to it when read.
FLOAT_FORMATS: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # symmetric: -128 unused
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
MIN_ABSMAX = 1e-12  # an all-zero row keeps a positive scale (no division by zero), and reads back as zeros


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache's values are stored in for a --kv-cache-dtype name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    named = FORMATS | FLOAT_FORMATS
    if kv_cache_dtype not in named:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(named)}, got {kv_cache_dtype!r}")
    return named[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def format_name(dtype: torch.dtype) -> str:
    """How memory stats name a cache of `dtype`: its --kv-cache-dtype name, or the model dtype's name."""
    names = {stored: name for name, stored in FORMATS.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `x [..., D]` as (values [..., D] of `dtype`, float32 scales [...]), one scale per row."""
    scales = x.float().abs().amax(-1).clamp_min(MIN_ABSMAX) / QMAX[dtype]
    return quantize_with(x, scales, dtype), scales


def quantize_with(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `x [..., D]` as `dtype` values at the given `scales [...]`; what lies beyond a scale's range
    saturates at +-QMAX."""
    qmax = QMAX[dtype]
    y = (x.float() / scales[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:  # floor(y + 0.5): the Triton kernel rounds the same way, so both write equal bytes
        return torch.floor(y + 0.5).to(dtype)
    return y.to(dtype)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 rows from quantized `values [..., D]` and their `scales [...]`."""
    return values.float() * scales[..., None]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte float tensor viewed as uint8: CPU torch has no index_copy/index_select kernels for float8, and
    moving quantized values (writes, swap, copy-on-write) is moving bytes. Other tensors come back as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
