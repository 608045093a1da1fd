"""The one rule: every request's num_computed_tokens catches up with num_tokens under the budgets."""

from __future__ import annotations

import pytest

from proto.wire import SamplingOptions, StepPlan, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import PreemptionCosts, Scheduler
from tests.support.plans import handle, named, scheduled

pytestmark = pytest.mark.unit


def make(
    num_blocks: int = 64,
    budget: int = 16,
    seqs: int = 8,
    host: int = 0,
    costs: PreemptionCosts | None = None,
    **config: object,
) -> Scheduler:
    cfg = SchedulerConfig(
        block_size=8,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=512,
        **config,  # type: ignore[arg-type]
    )
    return Scheduler(cfg, num_blocks, num_host_blocks=host, costs=costs)


def req(rid: str, prompt_len: int, max_tokens: int = 4, eos: frozenset[int] = frozenset()) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingOptions(0.0), StopConditions(max_tokens, eos))


def sample_all(plan: StepPlan, s: Scheduler, token: int = 99) -> StepResult:
    """What a worker would return: one token for each request that reached its end this step."""
    done = {
        h: [token]
        for h in plan.num_scheduled_tokens
        if (r := s.request_of(h)) and r.num_computed_tokens == r.num_tokens
    }
    return StepResult(plan.step_id, done)


def test_long_prompt_is_chunked_and_decodes_share_the_budget() -> None:
    s = make(budget=16)
    s.add(req("long", 40))
    s.add(req("short", 3))
    plan = s.schedule()
    assert scheduled(s, plan) == {"long": 16}  # FCFS: the budget goes to the head
    s.update(plan, sample_all(plan, s))
    plan = s.schedule()
    assert scheduled(s, plan) == {"long": 16}
    s.update(plan, sample_all(plan, s))
    plan = s.schedule()
    assert scheduled(s, plan) == {"long": 8, "short": 3}  # the tail of long, then short fits
    assert named(s, [c.handle for c in plan.cached_requests]) == ["long"]
    assert named(s, [n.handle for n in plan.new_requests]) == ["short"]
    s.update(plan, sample_all(plan, s))
    plan = s.schedule()
    assert scheduled(s, plan) == {"long": 1, "short": 1}  # both decode


def test_plans_carry_diffs_only() -> None:
    s = make(budget=64)
    s.add(req("a", 8, max_tokens=3))
    first = s.schedule()
    assert first.new_requests[0].block_ids == [0] and first.new_requests[0].prompt_token_ids == list(range(10, 18))
    s.update(first, sample_all(first, s))
    second = s.schedule()  # token 9 needs a second block
    assert not second.new_requests
    assert second.cached_requests[0].new_block_ids == (1,)
    assert second.cached_requests[0].num_computed_tokens == 8
    assert second.cached_requests[0].new_token_ids == ()  # one stage: the workers append their own samples


def test_max_num_seqs_caps_running_requests() -> None:
    s = make(seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 2))
    plan = s.schedule()
    assert set(scheduled(s, plan)) == {"r0", "r1"}
    assert len(s.waiting) == 2


def test_recompute_preemption_when_blocks_run_out_and_resume_in_full() -> None:
    s = make(num_blocks=3, budget=64, preemption_mode="recompute", enable_prefix_caching=False)
    s.add(req("old", 8, max_tokens=8))
    s.add(req("new", 8, max_tokens=8))
    plan = s.schedule()
    s.update(plan, sample_all(plan, s))
    plan = s.schedule()  # old needs block 3 of 3; new needs a 4th: the newest is preempted
    assert scheduled(s, plan) == {"old": 1}
    assert s.requests["new"].status is Status.PREEMPTED
    assert s.requests["new"].num_computed_tokens == 0
    assert named(s, plan.preempted) == ["new"]
    old = handle(s, "old")
    s.finish("old", Status.FINISHED_ABORTED)
    plan = s.schedule()
    (resumed,) = plan.new_requests
    assert named(s, [resumed.handle]) == ["new"] and resumed.output_token_ids == [99]  # prompt and output recomputed
    assert scheduled(s, plan) == {"new": 9}
    assert plan.finished == [old]


def test_stop_conditions_and_blocks_return_at_idle() -> None:
    s = make(budget=64)
    s.add(req("eos", 3, max_tokens=10, eos=frozenset({99})))
    s.add(req("len", 3, max_tokens=2))
    while s.has_work:
        plan = s.schedule()
        s.update(plan, sample_all(plan, s))
    assert s.blocks.num_free == s.blocks.num_blocks
    s.blocks.check_invariants()


def test_abort_frees_blocks_and_tells_the_worker() -> None:
    s = make()
    s.add(req("a", 10))
    s.schedule()
    assert s.blocks.num_used > 0
    a = handle(s, "a")
    assert (aborted := s.finish("a", Status.FINISHED_ABORTED)) is not None and aborted.status is Status.FINISHED_ABORTED
    assert s.blocks.num_free == s.blocks.num_blocks
    assert s.schedule().finished == [a]
    assert s.finish("a", Status.FINISHED_ABORTED) is None


def run_to_idle(s: Scheduler) -> list[StepPlan]:
    plans: list[StepPlan] = []
    while s.has_work:
        assert len(plans) < 1000, "no progress"
        plan = s.schedule()
        plans.append(plan)
        s.update(plan, sample_all(plan, s))
    return plans


def test_prefix_hit_skips_cached_blocks_but_recomputes_the_last_token() -> None:
    s = make(budget=64)
    s.add(req("first", 24, max_tokens=1))
    run_to_idle(s)
    s.add(req("second", 24, max_tokens=1))  # same 24 tokens: 3 full blocks cached
    plan = s.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 16  # the third block holds the last token: recomputed
    assert scheduled(s, plan) == {"second": 8}
    assert (s.counters.prefix_cache_queries, s.counters.prefix_cache_hits) == (48, 16)


def test_cache_salt_isolates_tenants() -> None:
    s = make(budget=64)
    s.add(req("a", 24, max_tokens=1))
    run_to_idle(s)
    salted = req("b", 24, max_tokens=1)
    salted.cache_salt = "tenant-b"
    s.add(salted)
    assert s.schedule().new_requests[0].num_computed_tokens == 0


def test_prefix_caching_can_be_turned_off() -> None:
    s = make(budget=64, enable_prefix_caching=False)
    s.add(req("a", 24, max_tokens=1))
    run_to_idle(s)
    s.add(req("b", 24, max_tokens=1))
    assert s.schedule().new_requests[0].num_computed_tokens == 0


def test_forks_share_the_prompt_and_copy_the_last_block_on_write() -> None:
    s = make(budget=64)
    parent, child = req("p", 12, max_tokens=3), req("c", 12, max_tokens=3)
    s.add(parent, forks=[child])
    plan = s.schedule()
    assert scheduled(s, plan) == {"p": 12}  # the sibling waits for the prompt
    s.update(plan, sample_all(plan, s))
    plan = s.schedule()
    assert scheduled(s, plan) == {"p": 1, "c": 1}  # the child recomputes only the last prompt token
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 11
    assert new.block_ids[0] == s.blocks.blocks_of("p")[0]  # the full first block is shared
    assert len(plan.block_copies) == 1  # the shared partial block was copied before the first write
    s.update(plan, sample_all(plan, s))
    run_to_idle(s)
    assert s.blocks.num_free == s.blocks.num_blocks
    s.blocks.check_invariants()


def test_swap_preemption_keeps_computed_tokens_and_swaps_back_in() -> None:
    s = make(num_blocks=3, budget=64, host=8, preemption_mode="swap")
    s.add(req("old", 8, max_tokens=8))
    s.add(req("new", 8, max_tokens=8))
    s.update(first := s.schedule(), sample_all(first, s))
    plan = s.schedule()  # old grows; new does not fit and is swapped out
    victim = s.requests["new"]
    assert victim.swapped and victim.num_computed_tokens == 8
    assert len(plan.swap_out) == 1 and s.counters.preemptions_swap == 1
    s.finish("old", Status.FINISHED_ABORTED)
    plan = s.schedule()
    assert len(plan.swap_in) == 1
    (resumed,) = plan.new_requests
    assert resumed.num_computed_tokens == 8 and scheduled(s, plan) == {"new": 1}  # no recompute
    s.update(plan, sample_all(plan, s))
    run_to_idle(s)
    assert s.blocks.num_host_used == 0


def test_elastic_picks_the_cheaper_preemption() -> None:
    def victim_mode(costs: PreemptionCosts) -> str:
        s = make(num_blocks=3, budget=64, host=8, costs=costs, preemption_mode="elastic")
        s.add(req("old", 8, max_tokens=8))
        s.add(req("new", 8, max_tokens=8))
        s.update(first := s.schedule(), sample_all(first, s))
        s.schedule()
        return "swap" if s.requests["new"].swapped else "recompute"

    block = 1 << 20
    assert victim_mode(PreemptionCosts(ms_per_token=10.0, bytes_per_block=block, swap_bytes_per_s=1e10)) == "swap"
    assert victim_mode(PreemptionCosts(ms_per_token=0.01, bytes_per_block=block, swap_bytes_per_s=1e8)) == "recompute"
    assert victim_mode(PreemptionCosts(ms_per_token=10.0, bytes_per_block=block, swap_bytes_per_s=0)) == "recompute"


def test_resize_moves_live_blocks_below_the_limit() -> None:
    s = make(num_blocks=8, budget=64)
    for i in range(4):
        s.add(req(f"r{i}", 4, max_tokens=3))  # one block each, room to decode in it
    s.update(first := s.schedule(), sample_all(first, s))
    assert [s.blocks.blocks_of(f"r{i}") for i in range(4)] == [[0], [1], [2], [3]]
    s.finish("r0", Status.FINISHED_ABORTED)  # frees the low blocks
    s.finish("r1", Status.FINISHED_ABORTED)
    moved = s.resize(3)
    assert moved == 1
    plan = s.schedule()
    assert plan.block_copies == [(3, 0)]
    assert plan.block_updates == {handle(s, "r3"): [(0, 0)]}  # only the request that moved: no empty entries
    assert not plan.preempted
    assert all(b < 3 for r in ("r2", "r3") for b in s.blocks.blocks_of(r))
    s.blocks.check_invariants()


def test_a_block_a_decode_fills_is_cached_by_that_step() -> None:
    s = make()
    r = req("a", 5, max_tokens=20)
    s.add(r)
    filled = 0
    while s.has_work:
        plan = s.schedule()
        s.update(plan, sample_all(plan, s))
        if r.status is Status.RUNNING:
            full = r.num_computed_tokens // 8  # the blocks its steps so far filled (one plan in flight at most)
            assert len(s.blocks.match_prefix(r.update_block_hashes(8)[:full])) == full
            filled = full
    assert filled == 2  # blocks filled by decodes (positions 8 and 16), not by the prompt
