"""The LM head's candidate search (worker_node/models/layers.py): the C pass and the chunked torch path, each
against torch's top-k."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_argmax
from worker_node.models.layers import CANDIDATE_CHUNK, rescore_top_logits, top_candidates

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


def test_rescoring_puts_the_exact_scores_of_the_top_candidates() -> None:
    weight, hidden = torch.randn(4 * CANDIDATE_CHUNK * 10, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    exact = hidden.float() @ weight.float().t()
    logits = rescore_top_logits(exact.bfloat16(), hidden, lambda rows: weight[rows].float())
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = exact.topk(4, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
