"""Verifying proposals in the target's step: the longest prefix the draws agree with plus one more draw, and a
statistical check that what comes out is distributed as the target model's own sampling (chi-square over thousands
of seeded samples of a tiny model's distribution, top-k and top-p applied)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from proto.wire import SamplingOptions
from worker_node.input_batch import RequestState
from worker_node.sampler import RowFlags, Sampler
from worker_node.spec_decode import accept, expand

pytestmark = pytest.mark.model

VOCAB = 64  # the tiny model's first 64 logits: a distribution small enough to count


def test_accept_keeps_the_agreeing_prefix_and_one_more() -> None:
    states = [RequestState(h, [1, 2], 2, SamplingOptions(0.0), h) for h in range(3)]
    drafts = [[5, 6, 7], [], [8]]
    rows, dr = expand(states, RowFlags(np.ones(3, bool), np.zeros(3, bool)), drafts, np.array([3, 4, 6]))  # type: ignore[arg-type]
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 6]  # the last known token's row and one per proposal
    drawn = [5, 6, 9, 4, 11, 8, 2]  # 5, 6 agree, 9 differs; none proposed; 8 agrees, then 2
    assert accept(drawn, dr) == [[5, 6, 9], [11], [8, 2]]


@torch.inference_mode()
def tiny_logits(folder: Path) -> tuple[torch.Tensor, int]:
    """A tiny model's logits over the first VOCAB tokens after a prompt and after the prompt + its likeliest next
    token (the proposal), and that proposal."""
    from tests.support.models import load_hf

    hf = load_hf(folder)
    prompt = [5, 17, 33, 2, 41]
    first = hf(torch.tensor([prompt])).logits[0, -1, :VOCAB]
    draft = int(first.argmax())
    second = hf(torch.tensor([prompt + [draft]])).logits[0, -1, :VOCAB]
    return torch.stack([first, second]).float() * 2, draft  # sharpened: some tokens likely, most not


def target(logits: torch.Tensor, top_k: int, top_p: float) -> np.ndarray:
    """The warped distribution the sampler draws from (HF's top-k then top-p)."""
    from worker_node import logits_processors as lp

    warped = lp.top_p(lp.top_k(logits.clone(), [top_k]), [top_p])
    return warped.softmax(-1)[0].double().numpy()


def test_verified_samples_follow_the_target_distribution(tiny_llama_dir: Path) -> None:
    logits, draft = tiny_logits(tiny_llama_dir)
    n, top_k, top_p = 6000, 8, 0.95
    options = [SamplingOptions(1.0, top_p, top_k, seed=s) for s in range(n)]
    states = [RequestState(i, [5, 17, 33, 2, 41], 5, o, i) for i, o in enumerate(options)]
    flags = RowFlags(np.zeros(n, bool), np.zeros(n, bool))
    rows, dr = expand(states, flags, [[draft]] * n, np.arange(1, 2 * n, 2))  # type: ignore[arg-type]
    tokens, _ = Sampler(VOCAB, torch.device("cpu")).sample(logits[rows % 2], dr.requests, dr.flags)
    outputs = accept(tokens, dr)
    p0, p1 = target(logits[:1], top_k, top_p), target(logits[1:], top_k, top_p)
    # The output is [x] for x != draft (probability p0(x)), or [draft, y] (probability p0(draft) p1(y)).
    expected: dict[tuple[int, ...], float] = {(int(x),): p0[x] for x in np.flatnonzero(p0) if x != draft}
    expected.update({(draft, int(y)): p0[draft] * p1[y] for y in np.flatnonzero(p1)})
    counts = {k: 0 for k in expected}
    for out in outputs:
        counts[tuple(out)] += 1  # KeyError: an outcome the target never gives
    assert 0.2 < p0[draft] < 0.9 and len(expected) > 6, "the test lost its point: a degenerate distribution"
    kept = [k for k in expected if expected[k] * n >= 5]  # chi-square wants 5 expected per cell
    rest_expected = n - sum(expected[k] * n for k in kept)
    rest_seen = n - sum(counts[k] for k in kept)
    chi2 = sum((counts[k] - expected[k] * n) ** 2 / (expected[k] * n) for k in kept)
    chi2 += (rest_seen - rest_expected) ** 2 / rest_expected if rest_expected >= 5 else 0.0
    df = len(kept) - (0 if rest_expected >= 5 else 1)
    critical = df + 4.0 * (2 * df) ** 0.5  # far above the 99.9th percentile for these df (about df + 3.1 sd)
    assert chi2 < critical, f"chi-square {chi2:.1f} over {df} degrees of freedom"


def test_seeded_verification_draws_what_plain_sampling_draws(tiny_llama_dir: Path) -> None:
    """A seeded request's first token is the same whether proposals are verified or not."""
    logits, draft = tiny_logits(tiny_llama_dir)
    options = [SamplingOptions(1.0, 0.95, 8, seed=s) for s in range(200)]
    states = [RequestState(i, [5, 17, 33, 2, 41], 5, o, i) for i, o in enumerate(options)]
    flags = RowFlags(np.zeros(200, bool), np.zeros(200, bool))
    sampler = Sampler(VOCAB, torch.device("cpu"))
    plain, _ = sampler.sample(logits[:1].repeat(200, 1), states, flags)  # type: ignore[arg-type]
    rows, dr = expand(states, flags, [[draft]] * 200, np.arange(1, 400, 2))  # type: ignore[arg-type]
    tokens, _ = sampler.sample(logits[rows % 2], dr.requests, dr.flags)
    assert [out[0] for out in accept(tokens, dr)] == plain
