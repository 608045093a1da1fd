"""Each sampling step against HF transformers' processor or warper: the same logits in, the same filtered
distribution out, exactly (bit for bit), with per-row parameters mixed in one batch; and the whole chain, as the
worker's Sampler runs it, against HF's LogitsProcessorList in the same order."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from proto.wire import SamplingOptions
from worker_node import logits_processors as lp
from worker_node.sampler import Sampler, _warp

pytestmark = pytest.mark.unit

VOCAB = 300
CPU = torch.device("cpu")


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def hf_rows(x: torch.Tensor, processors: list, input_ids: list[list[int]] | None = None) -> torch.Tensor:  # type: ignore[type-arg]
    """Row i through processors[i] alone, as HF runs a batch of one."""
    out = []
    for i, processor in enumerate(processors):
        ids = torch.tensor([input_ids[i] if input_ids else [0]])
        out.append(processor(ids, x[i : i + 1].clone())[0])
    return torch.stack(out)


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs)), "a different set of tokens survives"
    assert torch.equal(ours, theirs), "surviving logits differ"
    assert torch.equal(ours.softmax(-1), theirs.softmax(-1))


def test_temperature_matches_hf() -> None:
    temps = [0.3, 1.0, 1.7, 0.05]
    x = logits(4)
    assert_same(lp.temperature(x, temps), hf_rows(x, [TemperatureLogitsWarper(t) for t in temps]))


def test_top_k_matches_hf() -> None:
    ks = [1, 5, 40, 299]
    x = logits(4, 1)
    assert_same(lp.top_k(x, ks), hf_rows(x, [TopKLogitsWarper(k) for k in ks]))
    assert int((~torch.isneginf(lp.top_k(x, ks))).sum()) == sum(ks)


def test_top_p_matches_hf() -> None:
    ps = [0.05, 0.5, 0.9, 0.999]
    x = logits(4, 2)
    ours = lp.top_p(x, ps)
    assert_same(ours, hf_rows(x, [TopPLogitsWarper(p) for p in ps]))
    kept = (~torch.isneginf(ours)).sum(-1).tolist()
    assert kept == sorted(kept) and kept[0] < kept[-1], "a higher top_p keeps more tokens"


def test_min_p_matches_hf() -> None:
    mps = [0.01, 0.1, 0.5, 0.95]
    x = logits(4, 3)
    assert_same(lp.min_p(x, mps), hf_rows(x, [MinPLogitsWarper(m) for m in mps]))


def test_repetition_penalty_matches_hf() -> None:
    penalties = [1.3, 0.8, 2.0]
    seen_ids = [[3, 7, 7, 200], [1, 2, 3], [250, 5]]
    x = logits(3, 4)
    seen = torch.zeros(3, VOCAB, dtype=torch.bool)
    for i, ids in enumerate(seen_ids):
        seen[i, ids] = True
    ours = lp.repetition_penalty(x, seen, torch.tensor(penalties).unsqueeze(1))
    assert_same(ours, hf_rows(x, [RepetitionPenaltyLogitsProcessor(p) for p in penalties], seen_ids))
    assert not torch.equal(ours, x)


def test_logit_bias_matches_hf_sequence_bias() -> None:
    biases = [{5: 3.5, 17: -2.0}, {299: 100.0}, {0: -100.0, 5: 0.25}]
    x = logits(3, 5)
    ours = x.clone()
    triples = [(i, t, b) for i, bias in enumerate(biases) for t, b in bias.items()]
    lp.add_bias(ours, [i for i, _, _ in triples], [t for _, t, _ in triples], [b for _, _, b in triples])
    hf = [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]) for bias in biases]
    assert_same(ours, hf_rows(x, hf))


def test_bad_words_and_min_tokens_match_hf() -> None:
    """The sampler's bans (a bad word's last token after its prefix, end tokens before min_tokens) against HF's
    NoBadWords and MinNewTokensLength, over prompt and output as HF sees input_ids."""
    x = logits(3, 6)
    reqs = [
        Req(0, [9, 4, 5], 2, SamplingOptions(bad_words=[[7], [4, 5, 8], [1, 5, 9]])),  # [4, 5] ends the tokens
        Req(1, [4, 5], 2, SamplingOptions(bad_words=[[3, 4, 5, 6]], min_tokens=2, stop_token_ids=[2, 11])),
        Req(2, [6, 6, 1, 2], 1, SamplingOptions(min_tokens=3, stop_token_ids=[2])),  # 3 out: free to stop
    ]
    ours = Sampler(VOCAB, CPU)._process(x, reqs)
    hf = [
        NoBadWordsLogitsProcessor([[7], [4, 5, 8], [1, 5, 9]]),
        LogitsProcessorList(
            [NoBadWordsLogitsProcessor([[3, 4, 5, 6]]), MinNewTokensLengthLogitsProcessor(2, 2, [2, 11])]
        ),
        MinNewTokensLengthLogitsProcessor(1, 3, [2]),
    ]
    assert_same(ours, hf_rows(x, hf, [r.token_ids for r in reqs]))
    assert torch.isneginf(ours[0, [7, 8]]).all() and not torch.isneginf(ours[0, 9])
    assert torch.isneginf(ours[1, [2, 11]]).all() and not torch.isneginf(ours[2, 2])


@dataclass
class Req:
    handle: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)


def test_frequency_and_presence_penalties_follow_openai() -> None:
    """logit - frequency x count - presence x [count > 0], over output tokens only (no HF counterpart)."""
    x = logits(2, 7)
    reqs = [
        Req(0, [5, 6, 9, 9, 9, 6], 2, SamplingOptions(frequency_penalty=0.5, presence_penalty=1.5)),
        Req(1, [1, 2], 2, SamplingOptions(frequency_penalty=-1.0)),
    ]
    ours = Sampler(VOCAB, CPU)._process(x, reqs)
    expected = x.clone()
    for token, count in Counter([9, 9, 9, 6]).items():
        expected[0, token] -= 0.5 * count + 1.5
    assert torch.allclose(ours, expected, rtol=0, atol=1e-6)
    assert ours[0, 5] == x[0, 5], "a prompt-only token is not penalised"


def test_penalty_counts_follow_tokens_incrementally() -> None:
    """The worker's counts grow with each step's new tokens and start over for a request that comes back."""
    sampler = Sampler(VOCAB, CPU)
    req = Req(0, [5, 6, 9], 2, SamplingOptions(frequency_penalty=1.0))
    x = logits(1, 8)
    assert float(x[0, 9] - sampler._process(x, [req])[0, 9]) == pytest.approx(1.0)
    req.token_ids += [9, 9]
    assert float(x[0, 9] - sampler._process(x, [req])[0, 9]) == pytest.approx(3.0)
    sampler.forget(0)
    req.token_ids = [5, 6, 9]
    assert float(x[0, 9] - sampler._process(x, [req])[0, 9]) == pytest.approx(1.0)


CHAIN = [
    SamplingOptions(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.2, logit_bias={3: 2.0}),
    SamplingOptions(temperature=1.3, top_p=0.6),
    SamplingOptions(temperature=1.0, top_k=3, bad_words=[[4, 8], [12]]),
    SamplingOptions(temperature=0.5, min_p=0.2, min_tokens=4, stop_token_ids=[2, 3]),
    SamplingOptions(temperature=0.9),
]


def hf_chain(o: SamplingOptions, num_prompt: int) -> LogitsProcessorList:
    """HF's processors for `o`, in the order generate() builds them."""
    chain: list = []  # type: ignore[type-arg]
    if o.logit_bias:
        chain.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in o.logit_bias.items()]))
    if o.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(o.repetition_penalty))
    if o.bad_words:
        chain.append(NoBadWordsLogitsProcessor(o.bad_words))
    if o.min_tokens:
        chain.append(MinNewTokensLengthLogitsProcessor(num_prompt, o.min_tokens, o.stop_token_ids))
    chain.append(TemperatureLogitsWarper(o.temperature))
    if o.top_k > 0:
        chain.append(TopKLogitsWarper(o.top_k))
    if o.top_p < 1.0:
        chain.append(TopPLogitsWarper(o.top_p))
    if o.min_p > 0:
        chain.append(MinPLogitsWarper(o.min_p))
    return LogitsProcessorList(chain)


def test_mixed_batch_chain_matches_hf_row_by_row() -> None:
    x = logits(len(CHAIN), 9)
    reqs = [Req(i, [7, 4, 3, 1, 4], 3, o) for i, o in enumerate(CHAIN)]
    sampler = Sampler(VOCAB, CPU)
    ours = _warp(sampler._process(x, reqs), CHAIN)
    theirs = hf_rows(x, [hf_chain(o, 3) for o in CHAIN], [r.token_ids for r in reqs])
    assert_same(ours, theirs)


def test_seeded_draws_follow_the_filtered_distribution() -> None:
    """Seeded Gumbel-max draws land only where the filtered distribution has mass, with its frequencies."""
    x = logits(1, 10)
    options = SamplingOptions(temperature=0.8, top_k=6, seed=0)
    probs = _warp(x.clone(), [options]).softmax(-1)[0]
    sampler = Sampler(VOCAB, CPU)
    counts: Counter[int] = Counter()
    draws = 3000
    for seed in range(draws):
        req = Req(0, [1, 2], 2, SamplingOptions(temperature=0.8, top_k=6, seed=seed))
        sampler.start([req])
        counts[sampler.sample(x, [req])[0][0]] += 1
    assert set(counts) <= set(probs.nonzero().flatten().tolist())
    for token, n in counts.items():
        assert abs(n / draws - float(probs[token])) < 0.03, token


def test_seeded_sampling_ignores_the_rest_of_the_batch() -> None:
    x = logits(4, 11)
    alone = Req(0, [1, 2, 3], 2, SamplingOptions(temperature=1.0, top_p=0.9, seed=42))
    others = [Req(10 + i, [1, 2], 2, o) for i, o in enumerate(CHAIN[:3])]
    sampler = Sampler(VOCAB, CPU)
    sampler.start([alone])
    token_alone = sampler.sample(x[:1], [alone])[0][0]
    batch = [others[0], alone, others[1], others[2]]
    sampler.start(batch)
    mixed = sampler.sample(torch.cat([x[1:2], x[:1], x[2:4]]), batch)[0]
    assert mixed[1] == token_alone
