"""Building blocks of worker_node/models/layers.py tested alone: the top-logit search the rescoring uses."""

from __future__ import annotations

import pytest
import torch

from worker_node.models.layers import TOP_CHUNK, top_indices

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [49152, 100 * TOP_CHUNK, 1000])  # chunked, chunked, plain topk (not whole chunks)
def test_top_indices_finds_the_k_largest_as_topk_does(dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(16, vocab, generator=gen) * 4).to(dtype)
    logits[0, :] = -1.0  # ties everywhere but for the k best
    logits[0, [3, vocab - 1, TOP_CHUNK + 7, 5, 6, 7, 8, 9]] = torch.arange(8, dtype=dtype)
    logits[1, TOP_CHUNK : 2 * TOP_CHUNK] = 100.0 + torch.arange(TOP_CHUNK, dtype=dtype) / 8  # the best in one chunk
    got = top_indices(logits, 8)
    assert got.shape == (16, 8) and got.dtype == torch.int64
    want = logits.topk(8, dim=-1).values
    assert torch.equal(logits.gather(1, got).sort(-1, descending=True).values, want)
    assert all(len(set(row)) == 8 for row in got.tolist())
