"""LoRA adapters in PEFT's format, inspected and checked without torch: the same checks run in the scheduler
(when an adapter is registered, so a bad one is refused with a precise error before any request uses it) and in
the worker (before it reads the tensors).

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (PEFT's `save_pretrained`).
Only safetensors are read; a folder holding only `adapter_model.bin` is refused (unpickling runs arbitrary code).
Each tensor is `...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`: A is [r, in], B is [out, r], and the
projection's output gains `x @ A^T @ B^T * scale`, scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proto.checkpoints import pickle_refusal

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.[\w-]+)?\.weight\Z")
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_MAX_HEADER = 100 << 20


class AdapterError(ValueError):
    """An adapter that cannot be served over this base model; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """The base model's projection sizes, from its config.json (TP-independent: the full model's)."""

    hidden: int
    q_size: int  # heads * head_dim
    kv_size: int  # kv heads * head_dim
    intermediate: int
    num_layers: int
    experts: bool = False  # a mixture of experts: its MLP has no dense gate/up/down

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> BaseShapes:
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        kv_heads = c.get("num_key_value_heads") or heads
        return cls(
            c["hidden_size"],
            heads * head_dim,
            kv_heads * head_dim,
            c["intermediate_size"],
            c["num_hidden_layers"],
            bool(c.get("num_local_experts")),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> BaseShapes:
        return cls.from_config(json.loads((Path(folder) / "config.json").read_text()))

    def io(self, module: str) -> tuple[int, int]:
        """(inputs, outputs) of a projection."""
        return {
            "q_proj": (self.hidden, self.q_size),
            "k_proj": (self.hidden, self.kv_size),
            "v_proj": (self.hidden, self.kv_size),
            "o_proj": (self.q_size, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }[module]


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A checked adapter: where its tensors are, its rank and scale, and which (layer, module) it adapts."""

    folder: Path
    weights: Path
    rank: int
    scale: float
    modules: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict)  # -> (A name, B name)
    nbytes: int = 0


def inspect_adapter(folder: str | Path, base: BaseShapes, max_rank: int) -> AdapterInfo:
    """Read and check an adapter folder against the base model (AdapterError naming what is wrong)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"{folder}: no such adapter folder")
    config = _read_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = folder / "adapter_model.bin"
        if pickled.is_file():
            raise AdapterError(str(pickle_refusal(pickled)))
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE}")
    rank, scale = _rank_and_scale(config, folder, max_rank)
    header = read_safetensors_header(weights)
    modules: dict[tuple[int, str], dict[str, str]] = {}
    nbytes = 0
    for name, meta in header.items():
        match = _KEY.search(name)
        if match is None:
            raise AdapterError(
                f"{weights}: tensor {name} is not a LoRA A/B of a supported module ({', '.join(SUPPORTED_MODULES)})"
            )
        layer, module, which = int(match[1]), match[3], match[4]
        _check_tensor(weights, name, meta, layer, module, which, rank, base)
        modules.setdefault((layer, module), {})[which] = name
        nbytes += math.prod(meta["shape"]) * _DTYPE_BYTES[meta["dtype"]]
    if not modules:
        raise AdapterError(f"{weights}: holds no LoRA tensors")
    pairs = {}
    for (layer, module), found in sorted(modules.items()):
        if set(found) != {"A", "B"}:
            raise AdapterError(f"{weights}: layers.{layer}.{module} has lora_{''.join(found)} but not both A and B")
        pairs[(layer, module)] = (found["A"], found["B"])
    return AdapterInfo(folder, weights, rank, scale, pairs, nbytes)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{folder}: no {CONFIG_FILE} (a PEFT adapter folder has it)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    return config


def _rank_and_scale(config: dict[str, Any], folder: Path, max_rank: int) -> tuple[int, float]:
    where = folder / CONFIG_FILE
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for key, why in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"),
        ("layer_replication", "layer_replication"),
    ):
        if config.get(key):
            raise AdapterError(f"{where}: {key}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {config['bias']!r}: only bias 'none' is supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{where}: r {rank} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _check_tensor(
    weights: Path, name: str, meta: dict[str, Any], layer: int, module: str, which: str, rank: int, base: BaseShapes
) -> None:
    if module not in SUPPORTED_MODULES:
        raise AdapterError(f"{weights}: {name}: module {module} is not supported ({', '.join(SUPPORTED_MODULES)})")
    if module in MLP_MODULES and base.experts:
        raise AdapterError(
            f"{weights}: {name}: the base model's MLP is a mixture of experts; only attention modules can be adapted"
        )
    if not 0 <= layer < base.num_layers:
        raise AdapterError(f"{weights}: {name}: layer {layer} outside the base model's {base.num_layers}")
    if meta.get("dtype") not in _DTYPE_BYTES:
        raise AdapterError(f"{weights}: {name}: dtype {meta.get('dtype')} (float tensors only)")
    inputs, outputs = base.io(module)
    want = [rank, inputs] if which == "A" else [outputs, rank]
    if list(meta.get("shape", [])) != want:
        raise AdapterError(f"{weights}: {name}: shape {meta.get('shape')}, the base model and r={rank} need {want}")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors' names, dtypes and shapes of a safetensors file (its JSON header; no tensor is read)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{path}: not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise AdapterError(f"{path}: not a safetensors file (header of {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise AdapterError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    return header
