"""One request's non-finite logits fail that request alone: the sampler flags its row, the worker's result names
it (StepResult.faulted), the engine ends it with FAILED_PRECONDITION, and every other request of the same steps
gets exactly the tokens and logprobs it gets without it (issue 45)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from proto.wire import Message, SamplingOptions, StepError, StepPlan
from tests.support.engine import EngineRun, load_runner
from tests.support.sampling import SamplerRow
from worker_node.faults import RequestFault
from worker_node.plan_loop import StepThread
from worker_node.sampler import RowFlags, Sampler, SamplingRequest
from worker_node.step_overlap import DeviceTokens

VOCAB = 64


def _poison(row: torch.Tensor, how: str) -> None:
    if how == "nan anywhere":
        row[VOCAB // 2] = math.nan
    elif how == "+inf":
        row[3] = math.inf
    else:  # nothing finite: -inf everywhere
        row.fill_(-math.inf)


@pytest.mark.unit
@pytest.mark.parametrize("how", ["nan anywhere", "+inf", "all -inf"])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sampler_flags_exactly_the_rows_whose_logits_are_not_finite(
    how: str, sampled: bool, dtype: torch.dtype
) -> None:
    options = SamplingOptions(temperature=0.8, seed=3) if sampled else SamplingOptions(temperature=0.0)
    requests = [SamplerRow(i, [1, 2], 1, options) for i in range(4)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 5] = -math.inf  # a finite row may hold -inf (a banned token): not a fault
    clean = logits.clone()
    _poison(logits[2], how)
    drawn = Sampler(VOCAB, torch.device("cpu")).draw(logits, requests, RowFlags.of(requests))
    assert drawn.faulted is not None and drawn.faulted.tolist() == [False, False, True, False]
    alone = Sampler(VOCAB, torch.device("cpu")).draw(clean, requests, RowFlags.of(requests))
    if dtype == torch.float16:  # torch's argmax: the flags as a tensor
        assert alone.faulted is not None and not alone.faulted.any()
    else:  # the C kernel's count: a clean step says so without a tensor
        assert alone.faulted is None
    keep = [0, 1, 3]
    assert drawn.tokens[keep].tolist() == alone.tokens[keep].tolist(), "a faulted row changed another row's token"


@pytest.mark.unit
def test_device_tokens_carry_the_faulted_rows_in_the_same_copy() -> None:
    rows = [SamplerRow(h, [], 0, SamplingOptions()) for h in (40, 41, 42)]
    tokens = DeviceTokens(torch.tensor([7, 8, 9]), torch.tensor([False, True, False]), rows)
    assert tokens.values() == [7, 8, 9]
    assert tokens.faulted_handles() == [41]
    assert DeviceTokens(torch.tensor([7])).faulted_handles() == []


@pytest.mark.unit
def test_a_request_fault_is_answered_with_the_requests_it_names() -> None:
    """A plan that fails for some requests' own reasons is answered with a StepError naming them (the engine then
    fails those alone); the step thread goes on with the next plan."""
    replies: list[Message] = []

    def execute(plan: StepPlan) -> Message:
        if plan.step_id == 1:
            raise RequestFault([9, 4, 9], "adapter 'bad' cannot be read")
        raise RuntimeError("something else")

    steps = StepThread(0, execute, replies.append)
    steps.start()
    steps.inbox.put(StepPlan(1))
    steps.inbox.put(StepPlan(2))
    steps.stop()
    steps.join(10)
    first, second = replies
    assert isinstance(first, StepError) and first.handles == [4, 9] and "cannot be read" in first.reason
    assert isinstance(second, StepError) and second.handles == [] and "something else" in second.reason


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21, 22, 23, 24]]
VICTIM = 2  # PROMPTS[VICTIM]'s logits turn non-finite at its third output token
OPTIONS = [
    SamplingOptions(temperature=0.0, logprobs=2),
    SamplingOptions(temperature=0.0),
    SamplingOptions(temperature=0.0, logprobs=2),
    SamplingOptions(temperature=0.9, seed=11, logprobs=1),
    SamplingOptions(temperature=0.0),
]


def _generate(folder: Path) -> EngineRun:
    run = EngineRun(load_runner(folder, 64), tokenizer_dir=folder)
    with run:
        for prompt, options in zip(PROMPTS, OPTIONS):
            run.add(prompt, max_tokens=8, sampling=options)
        run.run()
    return run


@pytest.mark.model
@pytest.mark.parametrize("how", ["nan anywhere", "+inf"])
def test_non_finite_logits_fail_their_request_alone(
    tiny_llama_dir: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _generate(tiny_llama_dir)
    draw = Sampler.draw

    def poisoned(self: Sampler, logits: torch.Tensor, requests: Sequence[SamplingRequest], flags: RowFlags):  # type: ignore[no-untyped-def]
        victims = [
            i
            for i, r in enumerate(requests)
            if r.token_ids[: r.num_prompt_tokens] == PROMPTS[VICTIM] and len(r.token_ids) - r.num_prompt_tokens == 2
        ]
        if victims:
            logits = logits.clone()
            for i in victims:
                _poison(logits[i], how)
        return draw(self, logits, requests, flags)

    monkeypatch.setattr(Sampler, "draw", poisoned)
    mixed = _generate(tiny_llama_dir)
    for i, (before, after) in enumerate(zip(alone.submitted, mixed.submitted)):
        b, a = before.completions[0], after.completions[0]
        if i == VICTIM:
            assert a.finish_reason == "error" and "not finite" in a.error, a
            assert a.token_ids == b.token_ids[:2], "its tokens up to the fault, nothing of the faulted step"
            continue
        assert (a.finish_reason, a.token_ids, a.error) == (b.finish_reason, b.token_ids, ""), i
        # The batches lose a row after the fault: float32 sums in another order, so logprobs agree to rounding.
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4), i
        assert [[t for t, _ in lp.top] for lp in a.logprobs] == [[t for t, _ in lp.top] for lp in b.logprobs], i
    assert mixed.scheduler.blocks.num_used == 0
