"""Pipeline parallelism with P plans in flight: the scheduler keeps them on disjoint requests and hands every
rank the tokens the last stage sampled; two in-process stage runners overlap and still match HF greedy."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import Policy, PriorityPolicy
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler
from tests.support.engine import EngineRun, Submitted
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.plans import by_handle, handle, named
from tests.support.plans import scheduled as scheduled_ids
from tests.support.stages import stage_runners

pytestmark = pytest.mark.model

BLOCK = 16


def make(policy: Policy | None = None, seqs: int = 8, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(block_size=8, max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=512)
    return Scheduler(config, 64, policy, ExecutionMode.for_world(1, 2, async_scheduling=True))


def req(rid: str, prompt_len: int = 5, max_tokens: int = 4, priority: int = 0) -> Request:
    tokens = list(range(10, 10 + prompt_len))
    return Request(rid, tokens, SamplingOptions(0.0), StopConditions(max_tokens), priority)


def scheduled(s: Scheduler, plan: StepPlan) -> set[str]:
    return set(scheduled_ids(s, plan))


def new_tokens(s: Scheduler, plan: StepPlan) -> dict[str, list[int]]:
    return {
        r: list(c.new_token_ids)
        for r, c in zip(named(s, [c.handle for c in plan.cached_requests]), plan.cached_requests)
    }


def test_plans_in_flight_hold_disjoint_requests_and_carry_the_sampled_tokens() -> None:
    s = make()
    for i in range(4):
        s.add(req(f"r{i}"))
    first, second = s.schedule(), s.schedule()
    assert scheduled(s, first) == {"r0", "r1"} and scheduled(s, second) == {"r2", "r3"}  # half of them each
    assert not s.schedule().num_scheduled_tokens  # every request is in flight
    s.update(first, StepResult(first.step_id, by_handle(s, {"r0": [7], "r1": [8]})))
    third = s.schedule()
    assert scheduled(s, third) == {"r0", "r1"}
    assert new_tokens(s, third) == {"r0": [7], "r1": [8]}
    s.update(second, StepResult(second.step_id, by_handle(s, {"r2": [5], "r3": [6]})))
    fourth = s.schedule()
    assert new_tokens(s, fourth) == {"r2": [5], "r3": [6]}
    s.update(third, StepResult(third.step_id, by_handle(s, {"r0": [9], "r1": [9]})))
    assert [list(c.new_token_ids) for c in s.schedule().cached_requests] == [[9], [9]]  # only what the workers lack


def test_requests_finished_or_aborted_while_other_plans_are_in_flight() -> None:
    s = make()
    s.add(req("done", max_tokens=1))
    s.add(req("gone"))
    first, second = s.schedule(), s.schedule()
    assert scheduled(s, first) == {"done"} and scheduled(s, second) == {"gone"}
    done, gone = handle(s, "done"), handle(s, "gone")
    assert s.finish("gone", Status.FINISHED_ABORTED) is not None  # aborted while its plan runs
    s.update(first, StepResult(first.step_id, {done: [7]}))  # max_tokens reached
    third = s.schedule()
    assert sorted(third.finished) == sorted([done, gone]) and not third.num_scheduled_tokens
    assert s.update(second, StepResult(second.step_id, {gone: [8]})) == []  # its late token is dropped
    assert not s.has_work and not s.requests and s.blocks.num_free == 64


def test_request_preempted_while_in_flight_comes_back_only_after_its_result() -> None:
    s = make(PriorityPolicy(), seqs=2)
    s.add(req("b1", priority=30))
    s.add(req("b2", priority=40))
    first, second = s.schedule(), s.schedule()
    assert scheduled(s, first) == {"b2"} and scheduled(s, second) == {"b1"}
    s.add(req("rt", priority=90))
    third = s.schedule()  # rt takes the seat of b1, whose plan is still running
    assert named(s, third.preempted) == ["b1"] and scheduled(s, third) == {"rt"}
    s.update(first, StepResult(first.step_id, by_handle(s, {"b2": [7]})))
    s.finish("b2", Status.FINISHED_ABORTED)  # a seat is free, but b1's step has not come back
    assert "b1" not in scheduled(s, s.schedule())
    s.update(second, StepResult(second.step_id, by_handle(s, {"b1": [8]})))  # sampled before the preemption: dropped
    b1 = s.requests["b1"]
    assert b1.output_token_ids == [] and b1.num_placeholders == 0 and b1.status is Status.PREEMPTED
    fifth = s.schedule()
    assert named(s, [n.handle for n in fifth.new_requests]) == ["b1"] and fifth.new_requests[0].output_token_ids == []


def batch(run: EngineRun, seed: int) -> list[Submitted]:
    rng = random.Random(seed)
    shapes = ((5, 20), (17, 9), (40, 30), (3, 1), (33, 14), (16, 12))  # inside, at and across blocks; chunked
    return [run.add([rng.randrange(3, 49152) for _ in range(p)], m) for p, m in shapes]


def run_two_stages(folder: Path, num_blocks: int, hold: int = 0, **config: Any) -> EngineRun:
    runners = stage_runners(folder, num_blocks, BLOCK, stages=2, hold=hold)
    with EngineRun(runners, tokenizer_dir=folder, max_num_batched_tokens=24, **config) as run:
        reqs = batch(run, 3)
        run.run()
        assert run.scheduler.blocks.num_free == num_blocks
    hf = load_hf(folder)
    for r in reqs:
        assert len(r.output) == r.max_tokens
        assert_teacher_forced(hf, r.prompt, r.output)
    return run


def test_two_stages_overlap_and_match_hf(tiny_llama_dir: Path) -> None:
    """hold=2: stage 1 finishes its first plan only after stage 0 computed the second one. Stages in lock-step
    (a token broadcast at the end of each step) or a second plan left empty would time out here."""
    run = run_two_stages(tiny_llama_dir, 40, hold=2)
    first, second = (set(plan.num_scheduled_tokens) for plan in run.plans[:2])
    assert first and second and not first & second


def test_two_stages_match_hf_under_preemption(tiny_llama_dir: Path) -> None:
    run = run_two_stages(tiny_llama_dir, 8, preemption_mode="recompute")
    assert run.scheduler.num_preemptions > 0
