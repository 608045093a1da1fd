"""The LoRA manager's hooks and placement over the tiny Llama: an adapter with non-finite weights in one slot (forced
past every check) changes no other token's output, on every path (the whole stack, a few adapters' columns, the
slot bank); an adapter that cannot be read for its slot (gone, changed since registered, overflowing the serving
dtype) is an AdapterUnusable naming it, not its path, and leaves its slot empty as the scheduler counts it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from proto.lora import BaseShapes, inspect_adapter
from proto.wire import LoraAdapter
from tests.support.engine import load_runner
from tests.support.lora import poison, write_adapter
from worker_node.lora.checked_read import AdapterUnusable
from worker_node.lora.manager import LoraManager
from worker_node.lora.slot_bank import LoraCapacity

pytestmark = pytest.mark.model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> Any:
    return load_runner(tiny_llama_dir, 16, 16).model


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path) -> BaseShapes:
    return BaseShapes.from_folder(tiny_llama_dir)


# Each path's slots of the step's tokens (-1: the base model); slot 0 holds the non-finite adapter, 1 and 2 good ones.
PATHS = {
    "whole stack": (None, [-1, 0, 1, -1, 2, 1]),  # most resident adapters run: one masked matmul over them all
    "few of many": (None, [-1, 0, -1, -1]),  # one of three: its own columns, masked by rows
    "slot bank": (LoraCapacity(max_loras=3, max_rank=8), [-1, 0, 1, -1, 2]),  # the graph-safe layout
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_non_finite_adapter_reaches_no_other_token(
    model: Any, base: BaseShapes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    capacity, token_slots = PATHS[path]
    good = [write_adapter(tmp_path / f"good{i}", base, rank=8, seed=i) for i in range(3)]
    nan = poison(write_adapter(tmp_path / "nan", base, rank=8, seed=0), "A")

    def manager(slot0: Path) -> LoraManager:
        m = LoraManager(model, torch.float32, CPU, capacity)
        for slot, folder in enumerate((slot0, good[1], good[2])):
            m.place(LoraAdapter(10 + slot, str(folder), slot))
        return m

    clean = manager(good[0])  # slot 0 finite: the same stacks' shapes, so every other row's arithmetic is the same
    monkeypatch.setattr("proto.lora._check_finite", lambda *args: None)  # forced past the scheduler's check
    monkeypatch.setattr("worker_node.lora.manager.check_finite", lambda *args: None)  # and the worker's
    poisoned = manager(nan)
    proj = model.layers[0].self_attn.qkv_proj
    x = torch.randn(len(token_slots), model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    plain = proj(x)  # outside a step: the base projection alone
    slots = np.array(token_slots, dtype=np.int64)
    outputs = []
    for m in (clean, poisoned):
        with m.step(slots):
            outputs.append(proj(x))
    want, got = outputs
    assert torch.isnan(got[slots == 0]).all(), "the forced adapter runs on its own token"
    assert torch.equal(got[slots == -1], plain[slots == -1])
    others = slots != 0
    assert torch.equal(got[others], want[others]) and torch.isfinite(got[others]).all()


def _placed(model: Any, dtype: torch.dtype = torch.float32) -> LoraManager:
    return LoraManager(model, dtype, CPU)


def test_a_folder_gone_or_changed_since_registered_is_unusable_and_its_slot_empty(
    model: Any, base: BaseShapes, tmp_path: Path
) -> None:
    manager = _placed(model)
    first = write_adapter(tmp_path / "first", base, rank=8, seed=1)
    manager.place(LoraAdapter(1, str(first), 0, host_slots=1, name="first"))
    gone = write_adapter(tmp_path / "gone", base, rank=8, seed=2)
    registered = inspect_adapter(gone, base, 8).sha256
    shutil.rmtree(gone)
    lora = LoraAdapter(2, str(gone), 0, host_slots=1, name="gone", sha256=registered)
    with pytest.raises(AdapterUnusable, match=r"^LoRA adapter 'gone' \(id 2\) cannot be used: no such adapter folder$"):
        manager.place(lora)
    assert manager.slots == {} and list(manager.host) == [1]  # the scheduler's view: slot 0 evicted, not refilled

    write_adapter(gone, base, rank=8, seed=3)  # other weights under the same path: not what was registered
    with pytest.raises(AdapterUnusable, match=r"'gone' \(id 2\) cannot be used: its files changed since it was loaded"):
        manager.place(lora)
    with pytest.raises(AdapterUnusable) as unusable:
        manager.place(LoraAdapter(3, str(tmp_path / "never"), 0, name="never"))
    assert str(tmp_path) not in unusable.value.reason  # the clients see the name, the worker's log the path

    manager.place(LoraAdapter(1, str(first), 0, host_slots=1, name="first"))  # the slot serves again
    assert set(manager.slots) == {0} and manager.host_loads == 1


def test_an_update_that_overflows_the_serving_dtype_is_unusable(model: Any, base: BaseShapes, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "loud", base, rank=8, seed=1, alpha=1e7)  # finite, and in float32 too
    lora = LoraAdapter(1, str(folder), 0, name="loud")
    _placed(model, torch.float32).place(lora)
    half = _placed(model, torch.float16)
    with pytest.raises(AdapterUnusable, match=r"'loud' \(id 1\) cannot be used: layer 0 qkv_proj: .* float16"):
        half.place(lora)
    assert half.slots == {}
