"""The LM head's int8 copy (worker_node/models/quant_head.py): it scores a decode step's vocabulary, the top
candidates are rescored from the bf16 weight, so the argmax and the top logits are the bf16 head's exactly and the
rest are within int8's error; prefill-sized steps and a disabled copy use the bf16 weight."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_gemm
from worker_node.models.layers import RESCORED_LOGITS, ParallelLMHead
from worker_node.models.quant_head import DISABLE_ENV, int8_head
from worker_node.parallel import SINGLE, Comm

pytestmark = pytest.mark.unit

needs_int8 = pytest.mark.skipif(not cpu_gemm.has_int8(), reason="the int8 head needs AMX-INT8")
VOCAB, HIDDEN = 4096, 128


def _heads() -> tuple[ParallelLMHead, ParallelLMHead]:
    """The same bf16 head twice, the second with its int8 copy."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).bfloat16()
    heads = []
    for _ in range(2):
        head = ParallelLMHead(VOCAB, HIDDEN, SINGLE, Comm(SINGLE))
        head.weight = torch.nn.Parameter(weight, requires_grad=False)
        heads.append(head)
    heads[1].int8 = int8_head(weight)
    return heads[0], heads[1]


@needs_int8
@pytest.mark.parametrize("rows", [1, 16])
def test_the_top_logits_are_the_bf16_heads_and_the_rest_within_int8_error(rows: int) -> None:
    plain, quantized = _heads()
    assert quantized.int8 is not None and quantized.int8[0].dtype == torch.int8
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    want, got = plain(hidden), quantized(hidden)
    assert want is not None and got is not None and got.dtype == torch.float32
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    top = want.topk(RESCORED_LOGITS // 2, dim=-1).indices  # well inside both heads' rescored candidates
    assert torch.equal(got.gather(1, top), want.gather(1, top))  # rescored from the same bf16 rows
    assert not torch.equal(got, want)  # the others did come from the int8 copy
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@needs_int8
def test_prefill_sized_steps_use_the_bf16_weight() -> None:
    plain, quantized = _heads()
    hidden = torch.randn(cpu_gemm.MAX_ROWS + 1, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    want, got = plain(hidden), quantized(hidden)
    assert want is not None and got is not None and torch.equal(got, want)


def test_no_copy_where_the_kernel_would_not_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(VOCAB, HIDDEN).bfloat16()
    assert int8_head(weight.float()) is None  # float32 models keep their head
    assert int8_head(torch.randn(VOCAB, 96).bfloat16()) is None  # inputs not a multiple of the kernel's 64
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert int8_head(weight) is None
