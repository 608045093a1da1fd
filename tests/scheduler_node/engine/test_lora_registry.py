"""The adapters a server serves by name: checked when registered, ids never reused, names unique (the LoRA flags:
tests/settings/test_groups.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from proto.lora import AdapterError, BaseShapes
from scheduler_node.engine.lora_registry import LoraRegistry, UnknownAdapter

pytestmark = pytest.mark.unit

BASE = BaseShapes(hidden=64, q_size=64, kv_size=32, intermediate=128, num_layers=1)


def adapter(folder: Path, rank: int = 4) -> Path:
    folder.mkdir()
    name = "base_model.model.model.layers.0.self_attn.v_proj.lora_{}.weight"
    save_file({name.format("A"): torch.zeros(rank, 64), name.format("B"): torch.zeros(32, rank)},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8}))
    return folder


def test_names_are_unique_and_ids_are_never_reused(tmp_path: Path) -> None:
    registry = LoraRegistry(BASE, max_rank=8, base_name="tiny")
    first = registry.add("a", str(adapter(tmp_path / "a")))
    with pytest.raises(ValueError, match="loaded already"):
        registry.add("a", str(tmp_path / "a"))
    with pytest.raises(ValueError, match="the base model's name"):
        registry.add("tiny", str(tmp_path / "a"))
    with pytest.raises(ValueError, match="lora_name"):
        registry.add("bad name!", str(tmp_path / "a"))
    with pytest.raises(AdapterError, match="exceeds --max-lora-rank 8"):
        registry.add("big", str(adapter(tmp_path / "big", rank=16)))
    assert registry.remove("a") == first and registry.get("a") is None
    with pytest.raises(UnknownAdapter):
        registry.remove("a")
    again = registry.add("a", str(tmp_path / "a"))
    assert again.id != first.id and again.cache_salt == first.cache_salt  # same files: the same KV
    assert [r.name for r in registry.refs()] == ["a"]
