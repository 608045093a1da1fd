"""The adapters a server serves by name: checked when registered (read whole: every value), ids never reused,
names unique and whole; their content's checksum carried to the workers (the LoRA flags:
tests/settings/test_groups.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from proto.lora import AdapterError, BaseShapes
from scheduler_node.core.lora_slots import LoraSlots
from scheduler_node.engine.builder import lora_registry
from scheduler_node.engine.lora_registry import LoraRegistry, UnknownAdapter
from settings.lora import LoraConfig
from tests.support.lora import poison

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


@pytest.mark.parametrize("name", ["x\n", "x\ny", "\nx", "a b", "", "x" * 129])
def test_a_name_must_be_whole(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="lora_name"):
        LoraRegistry(BASE, max_rank=8).add(name, str(adapter(tmp_path / "a")))


def test_the_checksum_goes_to_the_workers_and_salts_the_cache(tmp_path: Path) -> None:
    registry = LoraRegistry(BASE, max_rank=8)
    ref = registry.add("a", str(adapter(tmp_path / "a")))
    copy = registry.add("b", str(adapter(tmp_path / "b")))  # the same content in another folder: the same KV
    assert len(ref.sha256) == 64 and copy.sha256 == ref.sha256 and copy.cache_salt == ref.cache_salt
    wire = LoraSlots(2).pin(ref)
    assert (wire.name, wire.sha256, wire.path) == ("a", ref.sha256, str((tmp_path / "a").resolve()))


def test_a_nan_adapter_is_refused_at_registration(tmp_path: Path) -> None:
    registry = LoraRegistry(BASE, max_rank=8)
    with pytest.raises(AdapterError, match=r"v_proj.lora_A.weight: \d+ of its \d+ values are NaN"):
        registry.add("nan", str(poison(adapter(tmp_path / "a"), "A")))
    assert registry.get("nan") is None
    model = tmp_path / "model"  # --lora-modules: the server does not start
    model.mkdir()
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    (model / "config.json").write_text(json.dumps(shape | {"num_hidden_layers": 1}))
    assert lora_registry(LoraConfig(True, (f"ok={adapter(tmp_path / 'ok')}",)), model) is not None
    with pytest.raises(AdapterError, match="values are NaN"):
        lora_registry(LoraConfig(True, (f"nan={tmp_path / 'a'}",)), model)
