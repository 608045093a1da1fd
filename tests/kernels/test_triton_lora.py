"""The LoRA kernels (kernels/triton_lora.py) in Triton's interpreter (TRITON_INTERPRET=1, conftest) against the torch
reference (kernels/torch_lora.py): tokens of several adapters of different ranks, of the base model and of an empty
slot in one launch, sizes that are no multiple of the blocks. Shapes stay tiny: the interpreter runs in Python."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.torch_lora import lora_add_reference  # noqa: E402
from kernels.triton_lora import lora_add  # noqa: E402
from tests.support.lora import small_config  # noqa: E402
from worker_node.lora.slot_bank import LoraCapacity, SlotBank  # noqa: E402
from worker_node.lora.weights import ProjectionLora  # noqa: E402
from worker_node.runtime.parallel import SINGLE  # noqa: E402

pytestmark = pytest.mark.unit


def _case(dtype: torch.dtype, tokens: int = 9, inputs: int = 40, outputs: int = 70):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    widths = torch.tensor([5, 0, 19, 8])  # slot 1 holds no adapter; slot 2's rank spans two rank blocks
    starts = torch.cumsum(widths, 0) - widths
    total = int(widths.sum())
    a = torch.randn(total, inputs, generator=gen).to(dtype)
    b = torch.randn(outputs, total, generator=gen).to(dtype)
    x = torch.randn(tokens, inputs, generator=gen).to(dtype)
    base = torch.randn(tokens, outputs, generator=gen).to(dtype)
    slots = torch.tensor([2, -1, 0, 3, 2, 1, 0, -1, 3][:tokens])
    return base, x, a, b, slots, starts, widths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_add_matches_the_torch_reference(dtype: torch.dtype) -> None:
    base, x, a, b, slots, starts, widths = _case(dtype)
    want = lora_add_reference(base, x, a, b, slots, starts, widths)
    got = lora_add(base, x, a, b, slots, starts, widths, max_width=int(widths.max()))
    assert got.dtype == dtype and got.shape == base.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
    untouched = (slots < 0) | (slots == 1)  # the base model's tokens and the empty slot's: base as it was
    assert torch.equal(got[untouched], base[untouched])
    assert not torch.equal(got[~untouched], base[~untouched])


def test_lora_add_refuses_stacks_that_do_not_fit() -> None:
    base, x, a, b, slots, starts, widths = _case(torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(base, x[:, :-1], a, b, slots, starts, widths, max_width=19)
    with pytest.raises(ValueError, match="must be"):
        lora_add(base[:-1], x, a, b, slots, starts, widths, max_width=19)


def test_lora_add_over_a_slot_bank_as_a_captured_graph_calls_it() -> None:
    """The arguments a decode graph records (worker_node/lora/manager.py): the bank's fixed stacks, its per-slot
    starts and widths, the slot width as max_width, and a slot-index buffer padded with -1; then the same call
    after another adapter is loaded into a slot in place."""
    cpu = torch.device("cpu")
    bank = SlotBank([(0, "qkv_proj")], small_config(), SINGLE, LoraCapacity(3, 8), torch.float32, cpu)
    proj = bank.projections[(0, "qkv_proj")]  # 24 columns a slot (3 fused modules x rank 8): two rank blocks
    gen = torch.Generator().manual_seed(4)

    def adapter(rank: int) -> ProjectionLora:
        return ProjectionLora(torch.randn(rank, 16, generator=gen), torch.randn(32, rank, generator=gen))

    bank.load(0, {(0, "qkv_proj"): adapter(20)})
    bank.load(2, {(0, "qkv_proj"): adapter(5)})
    x, base = torch.randn(8, 16, generator=gen), torch.randn(8, 32, generator=gen)
    slots = torch.tensor([2, -1, 0, 1, 0, 2, -1, -1])  # slot 1 empty; the last two rows: padding
    for _ in range(2):
        want = lora_add_reference(base, x, proj.a, proj.b, slots, proj.starts, proj.widths)
        got = lora_add(base, x, proj.a, proj.b, slots, proj.starts, proj.widths, max_width=proj.width)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        assert torch.equal(got[[1, 3, 6, 7]], base[[1, 3, 6, 7]])
        bank.load(0, {(0, "qkv_proj"): adapter(3)})  # the second round: slot 0 reloaded, smaller
