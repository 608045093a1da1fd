"""`engine.mixed_precision` in a `--config` file, as the vLLM article writes it, mapped onto our flags:

    engine:
      mixed_precision:
        matmul: int8       # bf16 | fp16 | fp32 (the model dtype) | int8 | fp8 | awq (weight formats)
        kv_cache: int8     # auto | the model dtype | int8 | fp8
        embedding: bf16    # the model dtype (embeddings are not quantized)

`matmul` sets `--dtype` (a float) or `--quantization` (a weight format); `embedding` sets `--dtype` (a quantized
matmul runs its activations, norms and embeddings in it); `kv_cache` sets `--kv-cache-dtype`. What the engine
cannot run is refused naming the key: a float KV cache or embedding other than the model dtype, two floats that
disagree, fp8 matmuls where the workers will run on the CPU (no fp8 arithmetic: `--quantization fp8` there only
halves the weights, so ask for it by that name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FLOATS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
FLOATS |= {"fp32": "float32", "float32": "float32"}
WEIGHT_FORMATS = {"int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8", "awq": "awq", "int4": "awq"}
KV_FORMATS = {"auto": "auto", "int8": "int8", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
KEYS = ("matmul", "kv_cache", "embedding")
FP8_HARDWARE = "a GPU with fp8 tensor cores (compute capability 8.9+: L4, H100, H200; or MI300X)"


class MixedPrecisionError(ValueError):
    """A mixed_precision setting the engine cannot run (the message names the key)."""


def mixed_precision_flags(engine: Any, device: str | None = None) -> dict[str, str]:
    """The flag values (`dtype`, `quantization`, `kv_cache_dtype`) an `engine:` section stands for. `device`: the
    command's --device where it has one (fp8 matmuls are refused on a CPU)."""
    if not isinstance(engine, dict) or set(engine) - {"mixed_precision"}:
        raise MixedPrecisionError("engine: only engine.mixed_precision is read from a config file")
    section = engine.get("mixed_precision") or {}
    if not isinstance(section, dict) or set(section) - set(KEYS):
        raise MixedPrecisionError(f"engine.mixed_precision: a mapping of {', '.join(KEYS)}, got {section!r}")
    values = {k: str(v).lower() for k, v in section.items() if v is not None}
    flags: dict[str, str] = {}
    dtype = _dtype(values)
    if dtype:
        flags["dtype"] = dtype
    matmul = values.get("matmul")
    if matmul in WEIGHT_FORMATS:
        flags["quantization"] = WEIGHT_FORMATS[matmul]
        if flags["quantization"] == "fp8" and on_cpu(device):
            raise MixedPrecisionError(
                f"engine.mixed_precision.matmul {matmul}: needs {FP8_HARDWARE}; the workers here run on the CPU "
                "(for fp8 weights dequantized to the model dtype, ask for quantization: fp8)"
            )
    elif matmul is not None:
        flags["quantization"] = "none"
    kv = values.get("kv_cache")
    if kv is not None:
        flags["kv_cache_dtype"] = _kv(kv, dtype)
    return flags


def _dtype(values: dict[str, str]) -> str | None:
    """The model dtype named by a float matmul and/or the embedding (they must agree)."""
    named = {}
    for key in ("matmul", "embedding"):
        value = values.get(key)
        if value is None:
            continue
        if value in FLOATS:
            named[key] = FLOATS[value]
        elif key == "embedding":
            raise MixedPrecisionError(
                f"engine.mixed_precision.embedding {value}: embeddings stay in a float dtype (bf16, fp16, fp32)"
            )
        elif value not in WEIGHT_FORMATS:
            raise MixedPrecisionError(
                f"engine.mixed_precision.matmul {value}: one of {', '.join([*FLOATS, *WEIGHT_FORMATS])}"
            )
    if len(set(named.values())) > 1:
        raise MixedPrecisionError(
            f"engine.mixed_precision.embedding {values['embedding']}: the model runs in one float dtype, and matmul "
            f"{values['matmul']} names another (quantize the matmuls, e.g. matmul: int8, to mix)"
        )
    return next(iter(named.values()), None)


def _kv(kv: str, dtype: str | None) -> str:
    if kv in KV_FORMATS:
        return KV_FORMATS[kv]
    if kv in FLOATS and dtype is not None and FLOATS[kv] == dtype:
        return "auto"
    raise MixedPrecisionError(
        f"engine.mixed_precision.kv_cache {kv}: the KV cache holds the model's dtype ({dtype or 'auto'}: say it, or "
        f"auto) or a quantized format ({', '.join(k for k in KV_FORMATS if k != 'auto')})"
    )


def on_cpu(device: str | None) -> bool:
    """Whether workers started with `--device device` on this host run on the CPU (auto: no NVIDIA/AMD driver)."""
    if device is None:
        return False  # the workers are elsewhere: they check their own device
    if device == "cpu":
        return True
    return device == "auto" and not (Path("/proc/driver/nvidia").exists() or Path("/dev/kfd").exists())
