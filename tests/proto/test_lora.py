"""PEFT adapters are checked against the base model before any tensor is read, with errors naming the problem."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from proto.lora import AdapterError, BaseShapes, inspect_adapter

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
