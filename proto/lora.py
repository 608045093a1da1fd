"""LoRA adapters in PEFT's format, read whole and checked without torch: the same checks run in the scheduler
(when an adapter is registered, so a bad one is refused with a precise error before any request uses it) and in
the worker (on the bytes it reads for a slot, which must be the ones the scheduler checked: `AdapterFiles.sha256`).

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (PEFT's `save_pretrained`).
Only safetensors are read; a folder holding only `adapter_model.bin` is refused (unpickling runs arbitrary code).
Each tensor is `...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`: A is [r, in], B is [out, r], and the
projection's output gains `x @ A^T @ B^T * scale`, scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

Every value must be finite and the scale finite and positive: one NaN in an adapter's B reaches every token of a
batch through the masked matmuls that serve many adapters at once (0 * NaN is NaN), so a NaN adapter would end
other tenants' requests, not only its own.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from proto.checkpoints import pickle_refusal

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.[\w-]+)?\.weight\Z")
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# Each float format's exponent bits, read as a little-endian unsigned integer: all set is an inf or a NaN.
_EXPONENT = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F64": ("<u8", 0x7FF << 52)}
_MAX_HEADER = 100 << 20


class AdapterError(ValueError):
    """An adapter that cannot be served over this base model: the message names the file and the field or tensor.
    `detail` is the message without the path (a worker tells it to clients, who must not learn the server's
    folders)."""

    def __init__(self, where: Path, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.detail = detail


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
class AdapterFiles:
    """An adapter's two files, read whole once: everything is checked and parsed from these bytes, never from the
    files again (which may change or vanish under a running server)."""

    config: bytes
    weights: bytes

    @property
    def sha256(self) -> str:
        """The content's checksum: the config's and the weights' bytes, each after its length (so no other pair of
        files hashes the same). The scheduler takes it at registration and the workers check their read against
        it; it also salts the adapter's prefix-cache hashes (the same content: the same KV)."""
        digest = hashlib.sha256()
        for part in (self.config, self.weights):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
        return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class TensorSpan:
    """One tensor of a safetensors file: its dtype and shape, and its bytes [start, end) in the whole file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A checked adapter: where its tensors are, its rank and scale, and which (layer, module) it adapts."""

    folder: Path
    weights: Path
    rank: int
    scale: float
    modules: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict)  # -> (A name, B name)
    nbytes: int = 0
    sha256: str = ""  # of the files it was checked from (AdapterFiles.sha256)


def inspect_adapter(folder: str | Path, base: BaseShapes, max_rank: int) -> AdapterInfo:
    """Read an adapter folder whole and check it against the base model (AdapterError naming what is wrong)."""
    folder = Path(folder).expanduser()
    return check_adapter(folder, read_adapter_files(folder), base, max_rank)


def read_adapter_files(folder: Path) -> AdapterFiles:
    """The adapter's config and safetensors weights, each read once (AdapterError: missing, unreadable, pickle)."""
    if not folder.is_dir():
        raise AdapterError(folder, "no such adapter folder")
    config = folder / CONFIG_FILE
    if not config.is_file():
        raise AdapterError(folder, f"no {CONFIG_FILE} (a PEFT adapter folder has it)")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = folder / "adapter_model.bin"
        if pickled.is_file():
            raise AdapterError(pickled, str(pickle_refusal(pickled)).removeprefix(f"{pickled} is "))
        raise AdapterError(folder, f"no {WEIGHTS_FILE}")
    return AdapterFiles(_read(config), _read(weights))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:  # its strerror: the exception's text repeats the path
        raise AdapterError(path, f"cannot be read ({exc.strerror or type(exc).__name__})") from None


def check_adapter(folder: Path, files: AdapterFiles, base: BaseShapes, max_rank: int) -> AdapterInfo:
    """Check an adapter's files against the base model: config, header, shapes, and every value finite."""
    rank, scale = _rank_and_scale(_parse_config(folder / CONFIG_FILE, files.config), folder / CONFIG_FILE, max_rank)
    weights = folder / WEIGHTS_FILE
    spans = parse_safetensors(weights, files.weights)
    modules: dict[tuple[int, str], dict[str, str]] = {}
    nbytes = 0
    for name, span in spans.items():
        match = _KEY.search(name)
        if match is None:
            raise AdapterError(
                weights, f"tensor {name} is not a LoRA A/B of a supported module ({', '.join(SUPPORTED_MODULES)})"
            )
        layer, module, which = int(match[1]), match[3], match[4]
        _check_tensor(weights, name, span, layer, module, which, rank, base)
        modules.setdefault((layer, module), {})[which] = name
        nbytes += span.end - span.start
    if not modules:
        raise AdapterError(weights, "holds no LoRA tensors")
    pairs = {}
    for (layer, module), found in sorted(modules.items()):
        if set(found) != {"A", "B"}:
            raise AdapterError(weights, f"layers.{layer}.{module} has lora_{''.join(found)} but not both A and B")
        pairs[(layer, module)] = (found["A"], found["B"])
    for name, span in spans.items():
        _check_finite(weights, name, span, files.weights)
    return AdapterInfo(folder, weights, rank, scale, pairs, nbytes, files.sha256)


def _parse_config(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise AdapterError(path, f"not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(path, "not a JSON object")
    return config


def _rank_and_scale(config: dict[str, Any], where: Path, max_rank: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(where, f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for key, why in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"),
        ("layer_replication", "layer_replication"),
    ):
        if config.get(key):
            raise AdapterError(where, f"{key}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(where, f"bias {config['bias']!r}: only bias 'none' is supported")
    rank = config.get("r")
    if not _is_int(rank) or rank < 1:
        raise AdapterError(where, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(where, f"r {rank} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    # JSON as Python reads it takes NaN and Infinity: a NaN scale would make every value of B NaN.
    if not _is_real(alpha) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(where, f"lora_alpha must be a finite number > 0, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if not math.isfinite(scale) or scale <= 0:
        raise AdapterError(where, f"lora_alpha {alpha!r} over r {rank} gives the scale {scale!r}")
    return rank, float(scale)


def _is_int(value: Any) -> TypeGuard[int]:
    """An integer of JSON, never a bool (which Python counts as an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> TypeGuard[float]:
    """A number of JSON (NaN and Infinity included, as Python reads them), never a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_tensor(
    weights: Path, name: str, span: TensorSpan, layer: int, module: str, which: str, rank: int, base: BaseShapes
) -> None:
    if module not in SUPPORTED_MODULES:
        raise AdapterError(weights, f"{name}: module {module} is not supported ({', '.join(SUPPORTED_MODULES)})")
    if module in MLP_MODULES and base.experts:
        raise AdapterError(
            weights, f"{name}: the base model's MLP is a mixture of experts; only attention modules can be adapted"
        )
    if not 0 <= layer < base.num_layers:
        raise AdapterError(weights, f"{name}: layer {layer} outside the base model's {base.num_layers}")
    inputs, outputs = base.io(module)
    want = [rank, inputs] if which == "A" else [outputs, rank]
    if list(span.shape) != want:
        raise AdapterError(weights, f"{name}: shape {list(span.shape)}, the base model and r={rank} need {want}")


def _check_finite(weights: Path, name: str, span: TensorSpan, data: bytes) -> None:
    """Every value of the tensor is finite: no exponent with all its bits set (an inf or a NaN in every format)."""
    import numpy as np  # here, not at the top: the scheduler imports this module and needs numpy only here

    kind, exponent = _EXPONENT[span.dtype]
    count = (span.end - span.start) // _DTYPE_BYTES[span.dtype]
    bits = np.frombuffer(data, dtype=kind, count=count, offset=span.start)
    bad = int(np.count_nonzero((bits & exponent) == exponent))
    if bad:
        raise AdapterError(weights, f"tensor {name}: {bad} of its {count} values are NaN or infinite")


def parse_safetensors(path: Path, data: bytes) -> dict[str, TensorSpan]:
    """The tensors of a safetensors file's bytes, every header entry checked as safetensors itself would load it
    (an object with a float dtype, a shape and offsets that fit the file, the tensors packed without gaps), so a
    file that passes here is one the workers can parse. AdapterError naming the tensor or key that is wrong."""
    if len(data) < 8:
        raise AdapterError(path, "not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > _MAX_HEADER or 8 + size > len(data):
        raise AdapterError(path, f"not a safetensors file (a header of {size} bytes in a file of {len(data)})")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError:
        raise AdapterError(path, "not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise AdapterError(path, "not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise AdapterError(path, "__metadata__ is not an object")
    start = 8 + size
    spans = {name: _span(path, name, entry, start, len(data)) for name, entry in header.items()}
    end = start
    for name, span in sorted(spans.items(), key=lambda item: item[1].start):
        if span.start != end:
            raise AdapterError(path, f"tensor {name}: its data starts at byte {span.start}, not where the last ended")
        end = span.end
    if end != len(data):
        raise AdapterError(path, f"the tensors end at byte {end} of a file of {len(data)} bytes")
    return spans


def _span(path: Path, name: str, entry: Any, start: int, size: int) -> TensorSpan:
    """One header entry as a TensorSpan with offsets in the whole file (`start`: where the tensor data begins)."""
    if not isinstance(entry, dict):
        raise AdapterError(path, f"tensor {name}: its header entry is {entry!r}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise AdapterError(path, f"tensor {name}: dtype {dtype!r} (float tensors only: {', '.join(_DTYPE_BYTES)})")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise AdapterError(path, f"tensor {name}: shape {shape!r} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(n) for n in offsets):
        raise AdapterError(path, f"tensor {name}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= size - start:
        raise AdapterError(
            path, f"tensor {name}: data_offsets {offsets} outside the file's {size - start} bytes of tensor data"
        )
    want = math.prod(shape) * _DTYPE_BYTES[dtype]
    if end - begin != want:
        raise AdapterError(path, f"tensor {name}: data_offsets {offsets} hold {end - begin} bytes, not {want}")
    return TensorSpan(dtype, tuple(shape), start + begin, start + end)
