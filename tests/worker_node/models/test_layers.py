"""The LM head's candidate search and rescoring (worker_node/models/layers.py): the C passes and the torch paths,
each against torch's top-k or float64 sums."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_argmax, cpu_gemm
from worker_node.models.layers import (
    CANDIDATE_CHUNK,
    RESCORED_LOGITS,
    ParallelLMHead,
    rescore_top_logits,
    top_candidates,
)
from worker_node.runtime.parallel import SINGLE, Comm

pytestmark = pytest.mark.unit


@pytest.fixture(params=["C", "torch"])
def search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each path in turn: the C pass (kernels/cpu_argmax.py), and the torch path where it declines."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_argmax, "top_rows", lambda logits, k: None)
    return str(request.param)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("k", [1, 8, 16])
def test_the_chunked_search_finds_torchs_top_k_values(rows: int, k: int, search: str) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + k)
    logits = (torch.randn(rows, 48 * CANDIDATE_CHUNK, generator=gen) * 4).bfloat16()  # bf16: many ties
    logits[0, :CANDIDATE_CHUNK] = logits[0].max()  # the whole row's best k all in one chunk, tied
    found = top_candidates(logits, k)
    assert found.shape == (rows, k) and all(len(set(r)) == k for r in found.tolist())  # k distinct tokens
    torch.testing.assert_close(
        logits.gather(1, found).sort(dim=-1).values, logits.topk(k, dim=-1).values.sort(dim=-1).values, rtol=0, atol=0
    )


@pytest.mark.parametrize("width", [CANDIDATE_CHUNK * 3 + 1, CANDIDATE_CHUNK * 8])  # not whole chunks; few chunks
def test_widths_the_chunks_do_not_serve_take_torchs_topk(width: int, search: str) -> None:
    logits = torch.randn(3, width)
    assert torch.equal(top_candidates(logits, 8).sort(-1).values, logits.topk(8, dim=-1).indices.sort(-1).values)


@pytest.mark.parametrize("path", ["C", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rescoring_puts_the_exact_scores_of_the_top_candidates(
    path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths (kernels/cpu_argmax.py's C pass, torch's gather where it declines): the top candidates carry
    float32 sums of the exact products, the others their rounded scores."""
    if path == "torch":
        monkeypatch.setattr(cpu_argmax, "rescore_rows", lambda *args: False)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(4 * CANDIDATE_CHUNK * 10, 72, generator=gen).to(dtype)
    hidden = torch.randn(3, 72, generator=gen).to(dtype)
    exact = hidden.double() @ weight.double().t()
    rounded = exact.bfloat16() if dtype == torch.bfloat16 else (exact + 1e-3).float()
    logits = rescore_top_logits(rounded, hidden, weight)
    assert logits.dtype == torch.float32 and torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = top_candidates(rounded, RESCORED_LOGITS)  # the candidates (rounded scores pick them)
    torch.testing.assert_close(logits.gather(1, top).double(), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    assert (logits.double() != exact).float().mean() > 0.9  # the others keep their rounded scores
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(logits[rest], rounded.float()[rest])


def test_the_c_rescoring_refuses_what_it_does_not_read() -> None:
    weight, hidden = torch.randn(512, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    logits, top = torch.zeros(2, 512), torch.tensor([[1, 2], [3, 512]])
    assert not cpu_argmax.rescore_rows(logits, hidden, weight, top)  # a candidate past the vocab
    assert torch.equal(logits, torch.zeros(2, 512))  # nothing written
    top[1, 1] = 4
    assert not cpu_argmax.rescore_rows(logits, hidden.float(), weight, top)  # mixed dtypes
    assert not cpu_argmax.rescore_rows(logits.bfloat16(), hidden, weight, top)  # bf16 logits
    assert not cpu_argmax.rescore_rows(logits, hidden, weight.t(), top)  # weight not [vocab, dim] contiguous
    if cpu_argmax.load() is not None:
        assert cpu_argmax.rescore_rows(logits, hidden, weight, top)
        assert torch.count_nonzero(logits) == 4


@pytest.mark.parametrize("kernel", [True, False])
def test_a_bf16_head_s_best_logits_are_float32_sums(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AMX kernel scores every token in float32 (`cpu_gemm.scores`); without it, torch's bf16 logits have
    their top candidates rescored. Either way each row's best logits are the unrounded sums."""
    if kernel and cpu_gemm.load() is None:
        pytest.skip("the AMX kernel needs AMX-BF16")
    if not kernel:
        monkeypatch.setattr(cpu_gemm, "scores", lambda *args: None)
    head = ParallelLMHead(1024, 64, SINGLE, Comm(SINGLE))
    head.weight.data = (torch.randn(1024, 64) * 0.1).bfloat16()
    hidden = torch.randn(20, 64).bfloat16()
    logits = head(hidden)
    assert logits is not None and logits.dtype == torch.float32
    exact = hidden.double() @ head.weight.double().t()
    best = exact.topk(2, dim=-1).indices  # (torch's rounded top 8 hold them)
    torch.testing.assert_close(logits.gather(1, best).double(), exact.gather(1, best), rtol=1e-5, atol=1e-5)
    # the kernel's every logit is a float32 sum; torch's others keep bf16's step
    off_grid = (logits != logits.bfloat16().float()).sum(-1)
    assert bool((off_grid > RESCORED_LOGITS).all() if kernel else (off_grid <= RESCORED_LOGITS).all())
