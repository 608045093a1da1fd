"""Speculative decoding on the scheduler: the config and its errors, the n-gram proposer, the policy, and the one
rule with proposals: a speculating decode schedules 1 + k tokens, the result's accepted tokens are appended and the
rejected proposals' slots rolled back."""

from __future__ import annotations

import pytest

from proto.wire import ExecutionMode, SamplingOptions, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.proposers import NgramProposer
from scheduler_node.core.request import Request, StopConditions
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.core.speculative import SpecState, eligible
from scheduler_node.core.speculator import Speculator
from settings.speculative import SpeculativeConfig, speculative_text

pytestmark = pytest.mark.unit

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize(
    "given, key",
    [
        ('{"method": "eagle"}', "method"),
        ('{"num_speculative_tokens": 4}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 4.5}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}', "prompt_lookup_min"),
        ('{"method": "ngram", "prompt_lookup_maximum": 2}', "prompt_lookup_maximum"),
        ('{"method": "ngram", "disable_by_batch_size": -1}', "disable_by_batch_size"),
        ('{"method": "draft_model"}', "model"),
        ('{"method": "ngram", "model": "/m"}', "model"),
        ('{"method": "draft_model", "model": 3}', "model"),
        ('["ngram"]', "speculative_config"),
        ("{method: ngram}", "speculative_config"),
    ],
)
def test_a_bad_config_names_its_key(given: str, key: str) -> None:
    with pytest.raises(ValueError, match=rf"speculative_config\b.*{key}|{key}"):
        SpeculativeConfig.parse(given)
    with pytest.raises(ValueError, match=key):
        speculative_text(given)


def test_config_as_vllm_spells_it() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert c == SpeculativeConfig("ngram", 5, 3, 1)
    assert SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig()
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse(None) is None
    again = SpeculativeConfig.parse(speculative_text({"method": "ngram", "prompt_lookup_max": 2}))
    assert again == SpeculativeConfig(prompt_lookup_max=2, prompt_lookup_min=1)


def req(rid: str, prompt: list[int], output: list[int] = (), max_tokens: int = 20, **sampling: object) -> Request:  # type: ignore[assignment]
    r = Request(rid, list(prompt), SamplingOptions(0.0, **sampling), StopConditions(max_tokens), spec=SpecState())  # type: ignore[arg-type]
    r.output_token_ids = list(output)
    return r


def test_ngram_proposes_what_followed_the_longest_latest_match() -> None:
    p = NgramProposer(NGRAM)
    r = req("a", [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3])
    # [2, 3] occurs twice before the end: the latest occurrence, then [4, 6, 7]
    assert p.propose(r, r.spec, 3) == [4, 6, 7]  # type: ignore[arg-type]
    r.output_token_ids += [4, 5]  # now [3, 4, 5] matches the first occurrence: its continuation
    assert p.propose(r, r.spec, 3) == [9, 2, 3]  # type: ignore[arg-type]
    assert p.propose(r, r.spec, 1) == [9]  # type: ignore[arg-type]
    r.output_token_ids.append(77)  # nothing ends with 77 before: no proposal
    assert p.propose(r, r.spec, 3) == []  # type: ignore[arg-type]


def test_ngram_never_matches_the_suffix_itself() -> None:
    p = NgramProposer(NGRAM)
    r = req("a", [5, 6, 7])
    assert p.propose(r, r.spec, 3) == []  # type: ignore[arg-type]
    r = req("b", [5, 5])
    assert p.propose(r, r.spec, 3) == [5]  # type: ignore[arg-type]
    # the latest match of a run ends right before the suffix: the first one, with k tokens after it, proposes
    r = req("c", [1, 7, 7, 7, 7, 7, 7])
    assert p.propose(r, r.spec, 3) == [7, 7, 7]  # type: ignore[arg-type]


def test_only_options_the_worker_verifies_exactly_speculate() -> None:
    assert eligible(SamplingOptions(0.0)) and eligible(SamplingOptions(0.7, top_k=5, top_p=0.9, seed=1))
    for bad in ({"logprobs": 0}, {"repetition_penalty": 1.2}, {"logit_bias": {3: 1.0}}, {"min_tokens": 2}):
        assert not eligible(SamplingOptions(0.0, **bad))  # type: ignore[arg-type]


def make(spec: SpeculativeConfig | None = NGRAM, blocks: int = 64, mode: ExecutionMode | None = None) -> Scheduler:
    config = SchedulerConfig(block_size=8, max_num_batched_tokens=64, max_model_len=512, speculative=spec)
    return Scheduler(config, blocks, mode=mode)


REPEATING = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


def test_a_speculating_decode_schedules_its_proposals_and_rolls_back_the_rejected() -> None:
    s = make()
    r = req("a", REPEATING)
    s.add(r)
    first = s.schedule()  # the prompt
    assert not first.all_cached_requests
    s.update(first, StepResult(first.step_id, {r.handle: [3]}))  # ... 1, 2, 3
    plan = s.schedule()
    (cached,) = plan.all_cached_requests
    assert cached.draft_token_ids == (4, 1, 2) and cached.num_scheduled_tokens == 4
    assert r.num_computed_tokens == len(REPEATING) + 1 + 3
    # the worker accepted 4 and 1, and sampled 9 after them
    (out,) = s.update(plan, StepResult(plan.step_id, {r.handle: [4, 1, 9]}))
    assert out.new_token_ids == [4, 1, 9]
    assert r.output_token_ids == [3, 4, 1, 9]
    assert r.num_computed_tokens == r.num_tokens - 1  # the rejected proposal's slot is not computed
    c = s.speculator.counters  # type: ignore[union-attr]
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (1, 3, 2, [1, 1, 0])


def test_proposals_stop_before_max_tokens_and_never_preempt() -> None:
    s = make()
    r = req("a", REPEATING, max_tokens=3)
    s.add(r)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {r.handle: [3]}))
    plan = s.schedule()
    assert plan.all_cached_requests[0].draft_token_ids == (4,)  # 3 tokens at most: one proposal and one sampled
    # with no block to spare, requests decode without proposals (which would need a third block each)
    s = make(blocks=4)
    both = [req(name, [1, 2, 3, 4] * 3 + [1, 2]) for name in "bc"]  # with their first tokens, 15 each
    for r in both:
        s.add(r)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {r.handle: [3] for r in both}))
    plan = s.schedule()
    assert [c.draft_token_ids for c in plan.all_cached_requests] == [(), ()] and not s.num_preemptions


def test_while_a_request_speculates_plans_run_one_at_a_time_with_every_request() -> None:
    """A plan built before the speculated step's result (as async scheduling does) is empty, the opted-out
    request's share included: requests taking turns would halve each step's batch. Once the result is applied the
    next plan holds them all again."""
    s = make()
    a, b, c = req("a", REPEATING), req("b", REPEATING), req("c", REPEATING)
    c.spec = None  # opted out
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {r.handle: [3] for r in (a, b, c)}))
    speculated = s.schedule()
    assert [len(x.draft_token_ids) for x in speculated.all_cached_requests] == [3, 3, 0]
    following = s.schedule()
    assert not following.has_work and not following.all_cached_requests
    s.update(speculated, StepResult(speculated.step_id, {a.handle: [4], b.handle: [4, 1], c.handle: [4]}))
    assert a.num_computed_tokens == a.num_tokens - 1 and b.num_computed_tokens == b.num_tokens - 1
    assert [x.handle for x in s.schedule().all_cached_requests] == [a.handle, b.handle, c.handle]


def test_under_pipeline_parallelism_one_plan_holds_every_speculating_request() -> None:
    """PP 2 (disjoint plans, tokens in plans): once requests speculate, one plan holds them all (in halves, each
    half would wait for the other's turn) and the plan after it is empty; each request's next plan brings the
    tokens its verify step accepted, its computed tokens rolled back, and its next proposals."""
    s = make(mode=ExecutionMode.for_world(1, 2, async_scheduling=True))
    rs = [req(name, REPEATING) for name in "abcd"]
    for r in rs:
        s.add(r)
    first = s.schedule()  # nothing runs yet: a plan's share of the seats, half
    assert [n.handle for n in first.new_requests] == [rs[0].handle, rs[1].handle]
    assert not s.schedule().has_work
    s.update(first, StepResult(first.step_id, {r.handle: [3] for r in rs[:2]}))
    every = s.schedule()  # the two speculate, the other two start: all four in one plan
    assert [(c.new_token_ids, c.draft_token_ids) for c in every.cached_requests] == [((3,), (4, 1, 2))] * 2
    assert [n.handle for n in every.new_requests] == [rs[2].handle, rs[3].handle]
    assert not s.schedule().has_work
    s.update(every, StepResult(every.step_id, {r.handle: [4, 7] if r in rs[:2] else [3] for r in rs}))
    assert [r.num_computed_tokens == r.num_tokens - 1 for r in rs] == [True] * 4
    following = s.schedule()
    assert [(c.handle, c.num_computed_tokens, c.new_token_ids) for c in following.cached_requests] == [
        (rs[0].handle, 12, (4, 7)),
        (rs[1].handle, 12, (4, 7)),
        (rs[2].handle, 10, (3,)),
        (rs[3].handle, 10, (3,)),
    ]


def test_requests_that_do_not_speculate_keep_the_overlap() -> None:
    """With no request speculating (opted out, paused for low acceptance, or a batch over the policy's size), plans
    overlap as without speculation."""
    s = make()
    a, c = req("a", REPEATING), req("c", REPEATING)
    c.spec = None
    for r in (a, c):
        s.add(r)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {r.handle: [3] for r in (a, c)}))
    assert a.spec is not None
    a.spec.pause = 5
    first = s.schedule()
    following = s.schedule()  # built before the first one's result
    assert [x.handle for x in first.all_cached_requests] == [x.handle for x in following.all_cached_requests]
    assert not any(x.draft_token_ids for x in first.all_cached_requests + following.all_cached_requests)
    # nor while the batch is bigger than the policy speculates for
    s = make(SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=1))
    both = [req(name, REPEATING) for name in "ab"]
    for r in both:
        s.add(r)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {r.handle: [3] for r in both}))
    first, following = s.schedule(), s.schedule()
    assert len(first.all_cached_requests) == len(following.all_cached_requests) == 2


def test_the_policy_pauses_a_request_whose_proposals_miss_and_big_batches() -> None:
    spec = Speculator(SpeculativeConfig(disable_by_batch_size=2))
    r = req("a", REPEATING)
    spec.admit(r)
    assert spec.drafts(r, 4)
    for _ in range(5):
        spec.observe(r, 4, 0)
    assert r.spec is not None and r.spec.pause and spec.drafts(r, 4) == []
    spec.begin_step([req(str(i), REPEATING) for i in range(3)])
    fresh = req("b", REPEATING)
    spec.admit(fresh)
    assert spec.drafts(fresh, 4) == []  # three running: more than disable_by_batch_size
    logprobs = req("c", REPEATING, logprobs=1)
    spec.admit(logprobs)
    assert logprobs.spec is None


def test_with_the_policy_off_speculation_costs_nothing_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """More requests running than disable_by_batch_size: no proposal is considered, no room computed, and no
    in-flight hold looked up (a plan of 64 decodes pays these 64 times a step)."""
    s = make(SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2))
    rs = [req(name, REPEATING) for name in "abc"]
    for r in rs:
        s.add(r)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, {r.handle: [3] for r in rs}))

    def never(*args: object) -> None:
        raise AssertionError("speculation did work while the policy is off")

    assert s.speculator is not None
    monkeypatch.setattr(s.speculator, "room", never)
    monkeypatch.setattr(s.in_flight, "held", never)
    monkeypatch.setattr(s.speculator, "drafts", never)
    for _ in range(3):
        plan = s.schedule()
        assert len(plan.all_cached_requests) == 3 and not any(c.draft_token_ids for c in plan.all_cached_requests)
        assert plan.propose == []
        s.update(plan, StepResult(plan.step_id, {r.handle: [4] for r in rs}))


def test_a_draft_model_proposes_what_the_worker_sent_while_it_follows_the_tokens() -> None:
    """method draft_model: the plan asks the worker for proposals of the requests that sample (StepPlan.propose);
    the result's drafts propose in the next plan, unless the request's tokens moved on since."""
    s = make(SpeculativeConfig(method="draft_model", model="/draft", num_speculative_tokens=3))
    a, b = req("a", [5, 6, 7]), req("b", [5, 6, 7])
    b.spec = None  # opted out: never asked for
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.propose == [a.handle]
    s.update(plan, StepResult(plan.step_id, {a.handle: [8], b.handle: [8]}, drafts={a.handle: [9, 10, 11]}))
    plan = s.schedule()
    assert [c.draft_token_ids for c in plan.all_cached_requests] == [(9, 10, 11), ()]
    assert plan.propose == [a.handle]
    s.update(plan, StepResult(plan.step_id, {a.handle: [9, 12], b.handle: [9]}, drafts={a.handle: [13, 14, 15]}))
    assert a.output_token_ids == [8, 9, 12] and a.num_computed_tokens == a.num_tokens - 1
    a.spec.drafted_at -= 1  # type: ignore[union-attr]  # as if a token arrived after the proposals were made
    plan = s.schedule()
    assert [c.draft_token_ids for c in plan.all_cached_requests] == [(), ()]
