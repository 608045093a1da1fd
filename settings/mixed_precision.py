"""`engine.mixed_precision` in a `--config` file, as the vLLM article writes it, mapped onto our flags:

    engine:
      mixed_precision:
        matmul: fp8        # bf16 | fp16 | fp32 (the model dtype) | int8 | fp8 | awq (weight formats)
        kv_cache: fp16     # auto | bf16 | fp16 | fp32 | int8 | fp8
        embedding: bf16    # the model dtype (embeddings are not quantized)

`matmul` sets `--dtype` (a float) or `--quantization` (a weight format); `embedding` sets `--dtype` (a quantized
matmul runs its activations, norms and embeddings in it); `kv_cache` sets `--kv-cache-dtype` (a float other than
the model's is a full-precision cache in that float: K/V are cast when written). fp8 matmuls on a GPU with fp8
tensor cores multiply in fp8; where the workers run on the CPU (no fp8 arithmetic) the weights are stored as fp8
and widened to the activation dtype in each matmul (half the weight memory, no speed-up), which is logged once.
What the engine cannot run is refused naming the key: an embedding that is not a float, two floats that disagree.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FLOATS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
FLOATS |= {"fp32": "float32", "float32": "float32"}
WEIGHT_FORMATS = {"int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8", "awq": "awq", "int4": "awq"}
KV_FORMATS = {"auto": "auto", "int8": "int8", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
KEYS = ("matmul", "kv_cache", "embedding")
FP8_HARDWARE = "a GPU with fp8 tensor cores (compute capability 8.9+: L4, H100, H200; or MI300X)"
_told: set[str] = set()  # what has been logged in this process (a config is read more than once per command)


class MixedPrecisionError(ValueError):
    """A mixed_precision setting the engine cannot run (the message names the key)."""


def mixed_precision_flags(engine: Any, device: str | None = None) -> dict[str, str]:
    """The flag values (`dtype`, `quantization`, `kv_cache_dtype`) an `engine:` section stands for. `device`: the
    command's --device where it has one (fp8 matmuls there are widened from fp8 weights: logged once)."""
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
            _log_once(
                f"engine.mixed_precision.matmul {matmul}: the workers run on the CPU, which has no fp8 arithmetic; "
                f"the weights are stored as fp8 and widened to {dtype or 'the model dtype'} in each matmul (half "
                f"the weight memory, no speed-up; fp8 matmuls need {FP8_HARDWARE})"
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
    """The --kv-cache-dtype of `kv_cache`: auto for the model's own float, a float's name for another (cast when
    written: worker_node/models/attention.py), or a quantized format."""
    if kv in KV_FORMATS:
        return KV_FORMATS[kv]
    if kv in FLOATS:
        return "auto" if FLOATS[kv] == dtype else FLOATS[kv]
    raise MixedPrecisionError(
        f"engine.mixed_precision.kv_cache {kv}: one of auto, {', '.join(FLOATS)}, "
        f"{', '.join(k for k in KV_FORMATS if k != 'auto')}"
    )


def _log_once(message: str) -> None:
    if message not in _told:
        _told.add(message)
        logger.warning("%s", message)


def on_cpu(device: str | None) -> bool:
    """Whether workers started with `--device device` on this host run on the CPU (auto: no NVIDIA/AMD driver)."""
    if device is None:
        return False  # the workers are elsewhere: they check their own device
    if device == "cpu":
        return True
    return device == "auto" and not (Path("/proc/driver/nvidia").exists() or Path("/dev/kfd").exists())
