"""The one rule: every request's num_computed_tokens catches up with num_tokens under the budgets."""

from __future__ import annotations

from proto.wire import SamplingOptions, StepPlan, StepResult
from scheduler_node.config import SchedulerConfig
from scheduler_node.request import Request, Status, StopConditions
from scheduler_node.scheduler import Scheduler


def make(num_blocks: int = 64, budget: int = 16, seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(block_size=8, max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=512)
    return Scheduler(config, num_blocks)


def req(rid: str, prompt_len: int, max_tokens: int = 4, eos: frozenset[int] = frozenset()) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingOptions(0.0), StopConditions(max_tokens, eos))


def sample_all(plan: StepPlan, s: Scheduler, token: int = 99) -> StepResult:
    """What a worker would return: one token for each request that reached its end this step."""
    done = {
        r: [token] for r in plan.num_scheduled_tokens if s.requests[r].num_computed_tokens == s.requests[r].num_tokens
    }
    return StepResult(plan.step_id, done)


def test_long_prompt_is_chunked_and_decodes_share_the_budget() -> None:
    s = make(budget=16)
    s.add(req("long", 40))
    s.add(req("short", 3))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"long": 16}  # FCFS: the budget goes to the head
    s.update(sample_all(plan, s))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"long": 16}
    s.update(sample_all(plan, s))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"long": 8, "short": 3}  # the tail of long, then short fits
    assert [c.req_id for c in plan.cached_requests] == ["long"]
    assert [n.req_id for n in plan.new_requests] == ["short"]
    s.update(sample_all(plan, s))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"long": 1, "short": 1}  # both decode


def test_plans_carry_diffs_only() -> None:
    s = make(budget=64)
    s.add(req("a", 8, max_tokens=3))
    first = s.schedule()
    assert first.new_requests[0].block_ids == [0] and first.new_requests[0].prompt_token_ids == list(range(10, 18))
    s.update(sample_all(first, s))
    second = s.schedule()  # token 9 needs a second block
    assert not second.new_requests
    assert second.cached_requests[0].new_block_ids == [1]
    assert second.cached_requests[0].num_computed_tokens == 8


def test_max_num_seqs_caps_running_requests() -> None:
    s = make(seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 2))
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {"r0", "r1"}
    assert len(s.waiting) == 2


def test_recompute_preemption_when_blocks_run_out_and_resume_in_full() -> None:
    s = make(num_blocks=3, budget=64)
    s.add(req("old", 8, max_tokens=8))
    s.add(req("new", 8, max_tokens=8))
    plan = s.schedule()
    s.update(sample_all(plan, s))
    plan = s.schedule()  # old needs block 3 of 3; new needs a 4th: the newest is preempted
    assert plan.num_scheduled_tokens == {"old": 1}
    assert s.requests["new"].status is Status.PREEMPTED
    assert s.requests["new"].num_computed_tokens == 0
    assert plan.preempted_req_ids == ["new"]
    s.finish("old", Status.FINISHED_ABORTED)
    plan = s.schedule()
    (resumed,) = plan.new_requests
    assert resumed.req_id == "new" and resumed.output_token_ids == [99]  # prompt and output recomputed
    assert plan.num_scheduled_tokens == {"new": 9}
    assert plan.finished_req_ids == ["old"]


def test_stop_conditions_and_blocks_return_at_idle() -> None:
    s = make(budget=64)
    s.add(req("eos", 3, max_tokens=10, eos=frozenset({99})))
    s.add(req("len", 3, max_tokens=2))
    while s.has_work:
        plan = s.schedule()
        s.update(sample_all(plan, s))
    assert s.blocks.num_free == s.blocks.num_blocks
    s.blocks.check_invariants()


def test_abort_frees_blocks_and_tells_the_worker() -> None:
    s = make()
    s.add(req("a", 10))
    s.schedule()
    assert s.blocks.num_used > 0
    assert s.finish("a", Status.FINISHED_ABORTED).status is Status.FINISHED_ABORTED
    assert s.blocks.num_free == s.blocks.num_blocks
    assert s.schedule().finished_req_ids == ["a"]
    assert s.finish("a", Status.FINISHED_ABORTED) is None
