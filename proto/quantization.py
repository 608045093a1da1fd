"""The weight formats a model may run in (`--quantization`), named where the scheduler and the worker both see them.

`none` runs the checkpoint's weights in the model dtype; `int8` (per-output-channel int8, weight-only) and `fp8`
(e4m3, per-output-channel scales) quantize a bf16/fp32 checkpoint as the worker loads it; `awq` (4-bit, groups of
128 input channels, zero points) reads an AutoAWQ checkpoint. A checkpoint whose config.json has a
`quantization_config` runs in its own format: `auto` (the default) takes it, a flag that names another is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QUANTIZATIONS = ("auto", "none", "int8", "awq", "fp8")
QUANTIZE_ON_LOAD = ("int8", "fp8")  # what a full-precision checkpoint can be quantized to as it loads
CHECKPOINT_FORMATS = ("awq", "fp8")  # what a checkpoint's quantization_config may name


def check_quantization(name: str, field: str = "quantization") -> str:
    """`name` if it is a known format; QuantizationError naming `field` otherwise."""
    if name not in QUANTIZATIONS:
        raise QuantizationError(f"{field}: must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")
    return name


class QuantizationError(ValueError):
    """A format this model, checkpoint or device cannot run in; the message names the key or flag."""


def checkpoint_quantization(folder: str | Path) -> dict[str, Any]:
    """The `quantization_config` of the folder's config.json ({} when the checkpoint is full precision)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    found = config.get("quantization_config") or {}
    if not isinstance(found, dict):
        raise QuantizationError(f"{folder}/config.json: quantization_config must be a mapping")
    return found


def resolve_quantization(requested: str, folder: str | Path) -> str:
    """The format the model runs in: the checkpoint's own when it has one, else `requested` (auto: none)."""
    check_quantization(requested)
    found = checkpoint_quantization(folder)
    if found:
        method = str(found.get("quant_method", "")).lower()
        if method not in CHECKPOINT_FORMATS:
            raise QuantizationError(
                f"{folder}/config.json: quantization_config.quant_method {method!r} is not supported "
                f"(supported: {', '.join(CHECKPOINT_FORMATS)})"
            )
        if requested not in ("auto", method):
            raise QuantizationError(
                f"--quantization {requested}: {folder} holds a {method} checkpoint "
                f"(config.json quantization_config.quant_method); use --quantization {method} or auto"
            )
        return method
    if requested in ("auto", "none"):
        return "none"
    if requested not in QUANTIZE_ON_LOAD:
        raise QuantizationError(
            f"--quantization {requested}: {folder} is a full-precision checkpoint (no quantization_config in its "
            f"config.json); {requested} needs a checkpoint in that format, only {', '.join(QUANTIZE_ON_LOAD)} "
            "can be made on load"
        )
    return requested
