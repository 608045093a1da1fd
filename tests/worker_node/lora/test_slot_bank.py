"""The LoRA slot bank (worker_node/lora/slot_bank.py): adapters copied into fixed, preallocated tensors in place (a
captured graph keeps reading the same memory), zero-padded past each adapter's rank, refused with a precise error
when they do not fit; and the manager's branch-free update over the bank, for a batch of adapters and base rows."""

from __future__ import annotations

import pytest
import torch

from kernels.torch_lora import lora_add_reference
from tests.support.lora import small_config
from worker_node.lora.slot_bank import LoraCapacity, SlotBank
from worker_node.lora.weights import ProjectionLora
from worker_node.runtime.parallel import SINGLE

pytestmark = pytest.mark.unit

CONFIG = small_config()
KEYS = [(layer, fused) for layer in range(2) for fused in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]


def _bank(max_loras: int = 3, max_rank: int = 4) -> SlotBank:
    return SlotBank(KEYS, CONFIG, SINGLE, LoraCapacity(max_loras, max_rank), torch.float32, torch.device("cpu"))


def _update(rank: int, inputs: int, outputs: int, seed: int) -> ProjectionLora:
    gen = torch.Generator().manual_seed(seed)
    return ProjectionLora(torch.randn(rank, inputs, generator=gen), torch.randn(outputs, rank, generator=gen))


def test_shapes_follow_the_fused_projections() -> None:
    bank = _bank()
    qkv, down = bank.projections[(0, "qkv_proj")], bank.projections[(1, "down_proj")]
    assert qkv.width == 3 * 4 and tuple(qkv.a.shape) == (3 * 12, 16) and tuple(qkv.b.shape) == (16 + 2 * 8, 36)
    assert down.width == 4 and tuple(down.a.shape) == (12, 24) and tuple(down.b.shape) == (16, 12)
    assert qkv.starts.tolist() == [0, 12, 24] and qkv.widths.tolist() == [0, 0, 0]
    assert bank.nbytes == sum(p.a.nbytes + p.b.nbytes for p in bank.projections.values())


def test_loading_a_slot_writes_in_place_and_zeroes_what_the_last_adapter_left() -> None:
    bank = _bank()
    proj = bank.projections[(0, "o_proj")]
    pointers = [(p.a.data_ptr(), p.b.data_ptr(), p.widths.data_ptr()) for p in bank.projections.values()]
    first = _update(4, 16, 16, seed=1)
    views = bank.load(1, {(0, "o_proj"): first, (1, "gate_up_proj"): _update(6, 16, 48, seed=2)})
    assert torch.equal(proj.a[4:8], first.a) and torch.equal(proj.b[:, 4:8], first.b)
    assert views[(0, "o_proj")].a.data_ptr() == proj.a[4:8].data_ptr()  # the adapter is held once: in the bank
    assert proj.widths.tolist() == [0, 4, 0] and bank.projections[(1, "gate_up_proj")].widths.tolist() == [0, 6, 0]

    second = _update(2, 16, 16, seed=3)  # another adapter into the same slot: smaller, one projection only
    bank.load(1, {(0, "o_proj"): second})
    assert pointers == [(p.a.data_ptr(), p.b.data_ptr(), p.widths.data_ptr()) for p in bank.projections.values()]
    assert torch.equal(proj.a[4:6], second.a) and not proj.a[6:8].any() and not proj.b[:, 6:8].any()
    assert proj.widths.tolist() == [0, 2, 0]
    gate_up = bank.projections[(1, "gate_up_proj")]
    assert gate_up.widths.tolist() == [0, 0, 0] and not gate_up.a.any() and not gate_up.b.any()
    bank.clear(1)
    assert not proj.a.any() and proj.widths.tolist() == [0, 0, 0]


def test_the_bank_with_its_starts_and_widths_gives_each_token_its_adapter() -> None:
    bank = _bank()
    updates = {slot: _update(rank, 16, 16, seed=10 + slot) for slot, rank in ((0, 3), (2, 4))}
    for slot, update in updates.items():
        bank.load(slot, {(0, "o_proj"): update})
    proj = bank.projections[(0, "o_proj")]
    gen = torch.Generator().manual_seed(7)
    x, base = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen)
    slots = torch.tensor([0, -1, 2, 1, 2, -1])  # slot 1 is empty: its token gets nothing, as the base rows
    got = lora_add_reference(base, x, proj.a, proj.b, slots, proj.starts, proj.widths)
    mine = slots[:, None] == proj.owner[None, :]
    masked = base + (x @ proj.a.t()).masked_fill(~mine, 0) @ proj.b.t()  # the manager's branch-free form
    for t, slot in enumerate(slots.tolist()):
        want = base[t] + (x[t] @ updates[slot].a.t() @ updates[slot].b.t() if slot in updates else 0)
        torch.testing.assert_close(got[t], want)
        torch.testing.assert_close(masked[t], want)


def test_an_adapter_that_does_not_fit_is_refused_and_the_slot_kept() -> None:
    bank = _bank(max_loras=2, max_rank=4)
    kept = _update(4, 16, 16, seed=1)
    bank.load(0, {(0, "o_proj"): kept})
    with pytest.raises(ValueError, match="slot 2 is outside the 2 slots of --max-loras"):
        bank.load(2, {})
    with pytest.raises(ValueError, match=r"layer 0 o_proj: .*\(rank <= 4 = --max-lora-rank x fused modules"):
        bank.load(0, {(0, "o_proj"): _update(5, 16, 16, seed=2)})
    with pytest.raises(ValueError, match="16 inputs"):
        bank.load(0, {(0, "o_proj"): _update(2, 15, 16, seed=2)})
    with pytest.raises(ValueError, match="layer 7's qkv_proj, which this worker does not adapt"):
        bank.load(0, {(7, "qkv_proj"): _update(2, 16, 32, seed=2)})
    proj = bank.projections[(0, "o_proj")]
    assert torch.equal(proj.a[:4], kept.a) and proj.widths.tolist() == [4, 0]
    with pytest.raises(ValueError, match="max_loras >= 1"):
        LoraCapacity(0, 8)
