"""Each sampling parameter through the whole engine (scheduler, wire, worker) on a tiny random Llama: every test
fails if its parameter is ignored, greedy ones match HF's argmax after HF's own processor on the same prefix, and a
batch mixing every parameter gives each request what it gets alone (seeded)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from proto.wire import SamplingOptions, StructuredOutput
from tests.support.engine import EngineRun, Submitted, load_runner
from tests.support.models import load_hf

pytestmark = pytest.mark.model

BLOCK = 16
VOCAB = 49152


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    return load_hf(tiny_llama_dir)


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def solo(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    """One engine that runs requests one at a time."""
    with EngineRun(load_runner(tiny_llama_dir, 40, BLOCK), tokenizer_dir=tiny_llama_dir) as run:
        yield run


def run_alone(run: EngineRun, ids: list[int], max_tokens: int, sampling: SamplingOptions, **add: Any) -> Submitted:
    sub = run.add(ids, max_tokens, sampling=sampling, **add)
    run.run()
    return sub


@torch.inference_mode()
def hf_scores(hf, ids: list[int], output: list[int], processors: LogitsProcessorList) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's logits at each output position after `processors` ran on that prefix (teacher-forced)."""
    logits = hf(torch.tensor([ids + output])).logits[0, len(ids) - 1 : -1].float()
    tokens = ids + output
    # transformers annotates input_ids as torch.LongTensor, a class torch.tensor's annotations never return
    prefixes = [cast(torch.LongTensor, torch.tensor([tokens[: len(ids) + i]])) for i in range(len(output))]
    return torch.stack([processors(prefix, logits[i : i + 1])[0] for i, prefix in enumerate(prefixes)])


def assert_hf_argmax(hf, ids: list[int], output: list[int], processors: LogitsProcessorList, tol: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
    scores = hf_scores(hf, ids, output, processors)
    chosen = scores.gather(1, torch.tensor(output)[:, None])[:, 0]
    gaps = (scores.max(-1).values - chosen).tolist()
    bad = [i for i, g in enumerate(gaps) if not g <= tol]
    assert not bad, f"token {bad[0]} ({output[bad[0]]}) is {gaps[bad[0]]} below HF's best after its processors"


def assert_in_hf_support(hf, ids: list[int], output: list[int], processors: LogitsProcessorList) -> None:  # type: ignore[no-untyped-def]
    scores = hf_scores(hf, ids, output, processors)
    chosen = scores.gather(1, torch.tensor(output)[:, None])[:, 0]
    assert not torch.isneginf(chosen).any(), "a token outside HF's filtered distribution was sampled"


GREEDY = SamplingOptions(temperature=0.0)


def test_repetition_penalty_matches_hf(solo: EngineRun, tiny_llama_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    """A random model rarely repeats itself; a bias on a prompt token and a new one makes it, the penalty stops it."""
    ids = prompt(1)
    bias = {ids[3]: 8.0, 4242: 7.0}
    plain = run_alone(solo, ids, 16, SamplingOptions(temperature=0.0, logit_bias=bias)).output
    options = SamplingOptions(temperature=0.0, logit_bias=bias, repetition_penalty=1.8)
    out = run_alone(solo, ids, 16, options).output
    assert len(set(plain)) < len(plain) and out != plain
    chain = [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]), RepetitionPenaltyLogitsProcessor(1.8)]
    assert_hf_argmax(hf, ids, out, LogitsProcessorList(chain))


class FrequencyPresence(LogitsProcessor):
    """OpenAI's penalties over the output tokens (HF has none)."""

    def __init__(self, num_prompt: int, frequency: float, presence: float) -> None:
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        counts[0].index_add_(0, input_ids[0, self.num_prompt :], torch.ones(input_ids.shape[1] - self.num_prompt))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def test_frequency_and_presence_penalties(solo: EngineRun, tiny_llama_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(2)
    bias = {4242: 7.0, 999: 6.0}  # tokens the model would repeat
    plain = run_alone(solo, ids, 20, SamplingOptions(temperature=0.0, logit_bias=bias)).output
    options = SamplingOptions(temperature=0.0, logit_bias=bias, frequency_penalty=1.5, presence_penalty=0.7)
    out = run_alone(solo, ids, 20, options).output
    assert len(set(plain)) < len(plain) and out != plain
    chain = [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]), FrequencyPresence(len(ids), 1.5, 0.7)]
    assert_hf_argmax(hf, ids, out, LogitsProcessorList(chain))


def test_logit_bias(solo: EngineRun, tiny_llama_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(3)
    plain = run_alone(solo, ids, 12, GREEDY).output
    bias = {plain[1]: -30.0, 777: 4.0}
    out = run_alone(solo, ids, 12, SamplingOptions(temperature=0.0, logit_bias=bias)).output
    assert out != plain and plain[1] not in out
    assert_hf_argmax(
        hf, ids, out, LogitsProcessorList([SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])])
    )


def test_bad_words(solo: EngineRun, tiny_llama_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(4)
    plain = run_alone(solo, ids, 12, GREEDY).output
    bad = [[plain[0]], [plain[2], plain[3]]]  # a one-token word, and a two-token one whose first token stays
    out = run_alone(solo, ids, 12, SamplingOptions(temperature=0.0, bad_words=bad)).output
    assert out != plain and plain[0] not in out
    assert_hf_argmax(hf, ids, out, LogitsProcessorList([NoBadWordsLogitsProcessor(bad)]))


def test_stop_token_ids_and_min_tokens(solo: EngineRun, tiny_llama_dir: Path) -> None:
    """A stop token made likely ends the output at once (its token kept, its text not); min_tokens holds it off
    until that many tokens are out. Async scheduling: the token sampled in flight after the stop is dropped."""
    ids = prompt(5)
    stop = 1000
    likely = SamplingOptions(temperature=0.0, logit_bias={stop: 50.0})
    ignored = run_alone(solo, ids, 8, likely)
    assert ignored.output == [stop] * 8, "without stop_token_ids it is an ordinary token"
    stopped = run_alone(solo, ids, 8, likely, stop_token_ids=[stop])
    assert stopped.output == [stop] and stopped.completions[0].finish_reason == "stop"
    assert stopped.completions[0].text == ""
    late = SamplingOptions(temperature=0.0, logit_bias={stop: 50.0}, min_tokens=4)
    held = run_alone(solo, ids, 8, late, stop_token_ids=[stop])
    assert len(held.output) == 5 and held.output[-1] == stop and stop not in held.output[:4]


@pytest.mark.parametrize(
    "options, warper",
    [
        (SamplingOptions(top_k=2, seed=1), TopKLogitsWarper(2)),
        (SamplingOptions(top_p=0.002, seed=2), TopPLogitsWarper(0.002)),
        (SamplingOptions(min_p=0.7, seed=3), MinPLogitsWarper(0.7)),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_seeded_samples_stay_in_hf_filtered_support(
    solo: EngineRun, tiny_llama_dir: Path, hf, options: SamplingOptions, warper
) -> None:  # type: ignore[no-untyped-def]
    """The random tiny model spreads its mass over the whole vocabulary: unfiltered draws would leave the support."""
    ids = prompt(6)
    out = run_alone(solo, ids, 24, options).output
    assert_in_hf_support(hf, ids, out, LogitsProcessorList([warper]))


def test_temperature(solo: EngineRun, tiny_llama_dir: Path) -> None:
    ids = prompt(7)
    greedy = run_alone(solo, ids, 16, GREEDY).output
    assert run_alone(solo, ids, 16, SamplingOptions(temperature=1e-4, seed=5)).output == greedy
    assert run_alone(solo, ids, 16, SamplingOptions(temperature=1.0, seed=5)).output != greedy


@torch.inference_mode()
def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logp = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return logp


def assert_prompt_logprobs(hf, ids: list[int], got: list, k: int) -> None:  # type: ignore[no-untyped-def, type-arg]
    logp = hf_prompt_logprobs(hf, ids)
    assert len(got) == len(ids) - 1
    expected = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([g.logprob for g in got]), expected, atol=1e-3)
    top_v, top_i = logp.topk(k, dim=-1)
    for i, g in enumerate(got):
        assert [t for t, _ in g.top] == top_i[i].tolist()
        assert torch.allclose(torch.tensor([v for _, v in g.top]), top_v[i], atol=1e-3)


def test_prompt_logprobs_over_chunks_prefix_hits_and_preemption(tiny_llama_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    """Each prompt token's logprob (and top 3) is HF's: over chunked prefill, for a prompt whose prefix is cached
    (it is recomputed: a cached prefix has no logits), and when preemption recomputes a half-done prompt."""
    rng = random.Random(8)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    asking = SamplingOptions(temperature=0.0, prompt_logprobs=3)
    runner = load_runner(tiny_llama_dir, 12, BLOCK)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_num_batched_tokens=24, preemption_mode="recompute") as run:
        first = run.add(shared + [5, 6], 4)  # caches the shared blocks
        run.run()
        again = run.add(shared + [7, 8, 9], 4, sampling=asking)
        crowd = [run.add([rng.randrange(3, VOCAB) for _ in range(n)], 30, sampling=asking) for n in (60, 33, 50)]
        run.run()
        assert run.scheduler.counters.prefix_cache_hits == 0, "a request asking for prompt logprobs hits nothing"
        assert run.scheduler.num_preemptions > 0
    assert first.completions[0].prompt_logprobs == []
    for sub in [again, *crowd]:
        assert_prompt_logprobs(hf, sub.prompt, sub.completions[0].prompt_logprobs, 3)


MIXED = [
    SamplingOptions(temperature=0.0, repetition_penalty=1.4),
    SamplingOptions(temperature=0.9, top_k=5, seed=11, frequency_penalty=0.8, presence_penalty=0.4),
    SamplingOptions(temperature=1.1, top_p=0.1, min_p=0.05, seed=12, logit_bias={42: 3.0, 900: -5.0}),
    SamplingOptions(temperature=0.0, bad_words=[[101], [7, 8]], prompt_logprobs=2),
    SamplingOptions(temperature=0.7, seed=13, min_tokens=3),
    SamplingOptions(temperature=1.0, seed=14, structured=StructuredOutput("regex", r"[a-z]{3,8}(-[0-9]{2}){1,3}")),
    SamplingOptions(temperature=1.0, seed=15, structured=StructuredOutput("choice", '["alpha", "beta", "gamma"]')),
    SamplingOptions(temperature=1.0, seed=16),
]


def test_a_batch_mixing_every_parameter_matches_each_alone(solo: EngineRun, tiny_llama_dir: Path) -> None:
    prompts = [prompt(20 + i, 6 + 3 * i) for i in range(len(MIXED))]
    stops = [[55] if o.min_tokens else [] for o in MIXED]
    alone = [run_alone(solo, p, 14, o, ignore_eos=False, stop_token_ids=s) for p, o, s in zip(prompts, MIXED, stops)]
    with EngineRun(load_runner(tiny_llama_dir, 60, BLOCK), tokenizer_dir=tiny_llama_dir) as run:
        together = [
            run.add(p, 14, sampling=o, ignore_eos=False, stop_token_ids=s) for p, o, s in zip(prompts, MIXED, stops)
        ]
        run.run()
    for a, t in zip(alone, together):
        assert t.output == a.output
        assert [x.logprob for x in t.completions[0].prompt_logprobs] == pytest.approx(
            [x.logprob for x in a.completions[0].prompt_logprobs], abs=1e-5
        )
    assert re.fullmatch(r"[a-z]{3,8}(-[0-9]{2}){1,3}", together[5].completions[0].text)
    assert together[6].completions[0].text in ("alpha", "beta", "gamma")
