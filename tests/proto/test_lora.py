"""PEFT adapters are read whole and checked against the base model when registered, with errors naming the
problem: shapes, every value finite, a finite positive scale, a safetensors header safetensors can load; and the
checksum the workers check their own read against follows the content."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from proto.lora import AdapterError, BaseShapes, inspect_adapter, read_adapter_files

pytestmark = pytest.mark.unit

BASE = BaseShapes(hidden=64, q_size=64, kv_size=32, intermediate=128, num_layers=2)
PREFIX = "base_model.model.model.layers"


def adapter(
    folder: Path, rank: int = 4, config: dict[str, Any] | None = None, shapes: dict[str, tuple[int, ...]] | None = None
) -> Path:
    """An adapter of q_proj and down_proj on both layers; `shapes` overrides a tensor's shape by short name."""
    shapes = shapes or {}
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(2):
        for block, module in (("self_attn", "q_proj"), ("mlp", "down_proj")):
            inputs, outputs = BASE.io(module)
            for which, shape in (("A", (rank, inputs)), ("B", (outputs, rank))):
                short = f"{layer}.{module}.{which}"
                tensors[f"{PREFIX}.{layer}.{block}.{module}.lora_{which}.weight"] = torch.zeros(
                    shapes.get(short, shape)
                )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(cfg | (config or {})))
    return folder


def test_a_good_adapter_gives_its_modules_rank_and_scale(tmp_path: Path) -> None:
    info = inspect_adapter(adapter(tmp_path / "a"), BASE, max_rank=8)
    assert info.rank == 4 and info.scale == 16 / 4
    assert sorted(info.modules) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
    assert info.nbytes == 2 * 4 * 4 * (64 + 64 + 128 + 64)
    rs = inspect_adapter(adapter(tmp_path / "rs", config={"use_rslora": True}), BASE, max_rank=8)
    assert math.isclose(rs.scale, 16 / 2)


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda p: adapter(p, rank=16), "r 16 exceeds --max-lora-rank 8"),
        (
            lambda p: adapter(p, shapes={"1.q_proj.A": (4, 32)}),
            r"q_proj.lora_A.weight: shape \[4, 32\].*need \[4, 64\]",
        ),
        (lambda p: adapter(p, config={"use_dora": True}), "use_dora: DoRA is not supported"),
        (lambda p: adapter(p, config={"bias": "all"}), "only bias 'none'"),
        (lambda p: adapter(p, config={"peft_type": "IA3"}), "only LORA adapters"),
        (lambda p: adapter(p, config={"r": 0}), "r must be a positive integer"),
    ],
)
def test_a_mismatched_adapter_is_refused_naming_why(tmp_path: Path, make: Any, error: str) -> None:
    with pytest.raises(AdapterError, match=error):
        inspect_adapter(make(tmp_path / "a"), BASE, max_rank=8)


def test_unsupported_modules_and_layers_are_refused(tmp_path: Path) -> None:
    folder = adapter(tmp_path / "a")
    extra = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 10)}
    save_file(extra, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="not a LoRA A/B of a supported module"):
        inspect_adapter(folder, BASE, 8)
    moe = BaseShapes(64, 64, 32, 128, 2, experts=True)
    with pytest.raises(AdapterError, match="mixture of experts"):
        inspect_adapter(adapter(tmp_path / "b"), moe, 8)
    with pytest.raises(AdapterError, match="layer 1 outside the base model's 1"):
        inspect_adapter(adapter(tmp_path / "c"), BaseShapes(64, 64, 32, 128, 1), 8)


def test_pickle_weights_and_half_adapters_are_refused(tmp_path: Path) -> None:
    folder = adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle"):
        inspect_adapter(folder, BASE, 8)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        inspect_adapter(folder, BASE, 8)
    with pytest.raises(AdapterError, match="no such adapter folder"):
        inspect_adapter(tmp_path / "missing", BASE, 8)
    half = adapter(tmp_path / "b")
    tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    save_file(tensors, str(half / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="lora_A but not both A and B"):
        inspect_adapter(half, BASE, 8)


def test_base_shapes_come_from_the_model_config() -> None:
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "num_hidden_layers": 2}  # fmt: skip
    assert BaseShapes.from_config(config) == BASE


def _set(folder: Path, short: str, value: float, dtype: torch.dtype = torch.float32) -> None:
    """One value of the tensor whose key contains `short` set to `value`, every tensor saved as `dtype`."""
    path = folder / "adapter_model.safetensors"
    tensors = {k: t.to(dtype) for k, t in load_file(str(path)).items()}
    name = next(k for k in tensors if short in k)
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    ("short", "value", "dtype"),
    [
        ("layers.1.self_attn.q_proj.lora_A", float("nan"), torch.float32),
        ("layers.0.mlp.down_proj.lora_B", float("inf"), torch.float32),
        ("layers.0.self_attn.q_proj.lora_B", float("-inf"), torch.float16),
        ("layers.1.mlp.down_proj.lora_A", float("nan"), torch.bfloat16),
        ("layers.0.self_attn.q_proj.lora_A", float("nan"), torch.float64),
    ],
)
def test_a_non_finite_value_is_refused_naming_its_tensor(
    tmp_path: Path, short: str, value: float, dtype: torch.dtype
) -> None:
    folder = adapter(tmp_path / "a")
    _set(folder, short, value, dtype)
    with pytest.raises(AdapterError, match=rf"tensor \S*{short}.weight: 1 of its \d+ values are NaN or infinite"):
        inspect_adapter(folder, BASE, 8)
    _set(folder, short, 1e4, dtype)  # the same file with a finite value there: served
    inspect_adapter(folder, BASE, 8)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 0, -16, True, "16"])
def test_a_non_finite_or_non_positive_lora_alpha_is_refused(tmp_path: Path, alpha: Any) -> None:
    folder = adapter(tmp_path / "a")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": alpha}))  # NaN, Infinity: JSON5
    with pytest.raises(AdapterError, match=r"adapter_config.json: lora_alpha must be a finite number > 0, got"):
        inspect_adapter(folder, BASE, 8)


def test_a_rank_of_true_is_no_rank(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="r must be a positive integer, got True"):
        inspect_adapter(adapter(tmp_path / "a", config={"r": True}), BASE, 8)


A0 = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"


def _raw(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (5, rf"tensor {A0}: its header entry is 5, not an object"),
        ({"dtype": "I64", "shape": [4, 64], "data_offsets": [0, 2048]}, rf"tensor {A0}: dtype 'I64' \(float"),
        ({"dtype": 7, "shape": [4, 64], "data_offsets": [0, 1024]}, rf"tensor {A0}: dtype 7"),
        ({"dtype": "F32", "shape": "4x64", "data_offsets": [0, 1024]}, rf"tensor {A0}: shape '4x64' is not"),
        ({"dtype": "F32", "shape": [4, 64], "data_offsets": [0]}, rf"tensor {A0}: data_offsets \[0\] is not"),
        ({"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 4096]}, rf"tensor {A0}: data_offsets .* outside"),
        ({"dtype": "F32", "shape": [4, 64], "data_offsets": [-8, 1016]}, rf"tensor {A0}: data_offsets .* outside"),
        ({"dtype": "F32", "shape": [4, 32], "data_offsets": [0, 1024]}, r"hold 1024 bytes, not 512"),
    ],
)
def test_a_malformed_header_entry_is_refused_naming_its_key(tmp_path: Path, entry: Any, error: str) -> None:
    folder = adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").write_bytes(_raw({A0: entry}, bytes(1024)))
    with pytest.raises(AdapterError, match=error):
        inspect_adapter(folder, BASE, 8)


def test_a_file_cut_short_or_with_gaps_is_refused(tmp_path: Path) -> None:
    folder = adapter(tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(AdapterError, match=r"data_offsets .* outside the file's \d+ bytes of tensor data"):
        inspect_adapter(folder, BASE, 8)
    weights.write_bytes(whole[:20])
    with pytest.raises(AdapterError, match="not a safetensors file"):
        inspect_adapter(folder, BASE, 8)
    entry = {"dtype": "F32", "shape": [4, 64], "data_offsets": [8, 1032]}
    weights.write_bytes(_raw({A0: entry}, bytes(1032)))
    with pytest.raises(AdapterError, match=rf"tensor {A0}: its data starts at byte"):
        inspect_adapter(folder, BASE, 8)
    weights.write_bytes(_raw({"__metadata__": [1]}, b""))
    with pytest.raises(AdapterError, match="__metadata__ is not an object"):
        inspect_adapter(folder, BASE, 8)


def test_the_checksum_follows_the_content(tmp_path: Path) -> None:
    first = inspect_adapter(adapter(tmp_path / "a"), BASE, 8)
    assert first.sha256 == read_adapter_files(tmp_path / "a").sha256 and len(first.sha256) == 64
    assert inspect_adapter(adapter(tmp_path / "b"), BASE, 8).sha256 == first.sha256  # the same bytes elsewhere
    assert inspect_adapter(adapter(tmp_path / "c", config={"lora_alpha": 32}), BASE, 8).sha256 != first.sha256
    _set(tmp_path / "b", "layers.0.self_attn.q_proj.lora_B", 0.5)
    assert inspect_adapter(tmp_path / "b", BASE, 8).sha256 != first.sha256
