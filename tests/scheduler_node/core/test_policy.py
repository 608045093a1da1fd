"""Policies: order, preemption for priority at the KV limit and the seat cap, hysteresis, no starvation."""

from __future__ import annotations

import pytest

from proto.wire import SamplingOptions, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.policy import DynamicPolicy, HybridPolicy, Policy, PriorityPolicy, StepChoice, make_policy
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler
from tests.support.plans import scheduled

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy: Policy, num_blocks: int = 64, seqs: int = 8, clock: Clock | None = None) -> Scheduler:
    config = SchedulerConfig(block_size=8, max_num_batched_tokens=64, max_num_seqs=seqs, max_model_len=512)
    return Scheduler(config, num_blocks, policy, clock=clock or Clock())


def req(rid: str, priority: int, prompt: int = 8, max_tokens: int = 50, at: float = 0.0, first: int = 100) -> Request:
    r = Request(rid, list(range(first, first + prompt)), SamplingOptions(0.0), StopConditions(max_tokens), priority)
    r.arrival_time = at
    return r


def step(s: Scheduler) -> dict[str, int]:
    """One step; what it scheduled, by request id."""
    plan = s.schedule()
    names = scheduled(s, plan)
    done = {r.handle: [7] for r in map(s.requests.__getitem__, names) if r.num_computed_tokens == r.num_tokens}
    s.update(plan, StepResult(plan.step_id, done))
    return names


def test_higher_priority_is_admitted_first() -> None:
    s = make(PriorityPolicy(), seqs=1)
    s.add(req("batch", 30, at=0.0))
    s.add(req("realtime", 90, at=1.0))
    assert list(step(s)) == ["realtime"]


def test_fcfs_ignores_priority() -> None:
    s = make(Policy(), seqs=1)
    s.add(req("batch", 30, at=0.0))
    s.add(req("realtime", 90, at=1.0))
    assert list(step(s)) == ["batch"]


@pytest.mark.parametrize("policy", [PriorityPolicy, HybridPolicy, DynamicPolicy])
def test_priority_displaces_at_the_seat_cap(policy: type[Policy]) -> None:
    s = make(policy(), seqs=2)
    s.add(req("b1", 30))
    s.add(req("b2", 40))
    step(s)
    step(s)  # b1's prefill waited for b2's, which outranks it by the margin
    s.add(req("rt", 90, at=1.0))
    plan = step(s)
    assert "rt" in plan
    assert s.requests["b1"].status is Status.PREEMPTED  # the least valued one
    assert s.requests["b2"].status is Status.RUNNING


def test_priority_displaces_at_the_kv_limit() -> None:
    s = make(PriorityPolicy(), num_blocks=4, seqs=8)
    s.add(req("batch", 30, prompt=24))  # 3 of 4 blocks
    step(s)
    s.add(req("rt", 90, prompt=16, at=1.0, first=500))  # needs 2
    plan = step(s)
    assert "rt" in plan and s.requests["batch"].status is Status.PREEMPTED


def test_no_displacement_when_the_prefix_cache_makes_room() -> None:
    s = make(PriorityPolicy(), num_blocks=4, seqs=8)
    s.add(req("batch", 30, prompt=20))  # 3 of 4 blocks (two full ones cached once computed), room to decode
    step(s)
    s.add(req("rt", 90, prompt=16, at=1.0))  # the batch request's first 16 tokens: one block hit, one new
    plan = step(s)
    assert "rt" in plan
    assert s.requests["batch"].status is Status.RUNNING, "it fitted through the cache: nobody is displaced"
    assert s.counters.prefix_cache_hits == 8


def test_hysteresis_no_displacement_within_the_margin_and_no_ping_pong() -> None:
    s = make(PriorityPolicy(preemption_margin=5), seqs=1)
    s.add(req("a", 50))
    step(s)
    s.add(req("b", 53, at=1.0))  # better, but not by the margin
    for _ in range(10):
        step(s)
    assert s.num_preemptions == 0 and s.requests["a"].status is Status.RUNNING
    s.add(req("c", 60, at=2.0))  # beats a by 10: one displacement, and nothing displaces c back
    for _ in range(10):
        step(s)
    assert s.num_preemptions == 1


def sustained_load(s: Scheduler, clock: Clock, steps: int) -> float | None:
    """Keep two realtime requests waiting at every step (both seats stay busy); return when `low` starts."""
    s.add(req("low", 20, max_tokens=4, at=0.0))
    for i in range(steps):
        clock.now = i * 0.5
        while sum(1 for r in s.waiting if r.req_id != "low") < 2:
            s.add(req(f"rt{clock.now}-{len(s.requests)}", 90, max_tokens=6, at=clock.now))
        if "low" in step(s):
            return clock.now
    return None


def test_aging_bounds_starvation_under_sustained_high_priority_load() -> None:
    clock = Clock()
    aging = 1.0
    s = make(HybridPolicy(aging_interval=aging, preemption_margin=5.0), seqs=2, clock=clock)
    started_at = sustained_load(s, clock, 400)
    # (P - p) x aging_interval plus twice one realtime request's service time (7 steps of 0.5 s): policy.py
    bound = (90 - 20) * aging + 2 * 7 * 0.5
    assert started_at is not None and started_at <= bound, (started_at, bound)


def test_dynamic_orders_by_class_then_by_tokens_left() -> None:
    s = make(DynamicPolicy(), seqs=1)
    s.add(req("batch-short", 30, max_tokens=2))
    s.add(req("long", 50, max_tokens=320, at=1.0))  # 5 points of tokens left: still above the batch class
    s.add(req("short", 50, max_tokens=3, at=2.0))
    assert list(step(s)) == ["short"]  # the class first, then few tokens left
    while s.requests.get("short") is not None:
        step(s)
    assert list(step(s)) == ["long"]
    for _ in range(5):
        step(s)
    assert s.requests["batch-short"].status is Status.WAITING


def test_dynamic_tokens_left_do_not_outweigh_the_margin() -> None:
    """A long request of the same class does not displace a short one, nor a short one a long one: the term is
    a few points, less than the margin between classes."""
    s = make(DynamicPolicy(preemption_margin=5.0), seqs=1)
    s.add(req("long", 50, max_tokens=200))
    step(s)
    s.add(req("short", 50, max_tokens=2, at=0.0))
    for _ in range(5):
        step(s)
    assert s.num_preemptions == 0 and s.requests["long"].status is Status.RUNNING


def test_dynamic_aging_bounds_starvation_under_sustained_high_priority_load() -> None:
    clock = Clock()
    aging = 1.0
    s = make(DynamicPolicy(aging_interval=aging, preemption_margin=5.0), seqs=2, clock=clock)
    started_at = sustained_load(s, clock, 400)
    # policy.py: (P - p + max_tokens / short_job_tokens) x aging_interval + 2 S, with `low`'s 4 tokens
    bound = (90 - 20 + 4 / DynamicPolicy.short_job_tokens) * aging + 2 * 7 * 0.5
    assert started_at is not None and started_at <= bound, (started_at, bound)


def test_without_aging_the_low_request_starves() -> None:
    clock = Clock()
    assert sustained_load(make(PriorityPolicy(), seqs=2, clock=clock), clock, 400) is None


def test_custom_policy_by_dotted_path() -> None:
    policy = make_policy("deploy.custom_policy:ShortestJobFirst")
    s = make(policy, seqs=1)
    s.add(req("long", 50, max_tokens=200))
    s.add(req("short", 50, max_tokens=3, at=1.0))
    assert list(step(s)) == ["short"]


@pytest.mark.parametrize("name", ["nope", "deploy.custom_policy:Missing", "no_such_module:X", "builtins:dict"])
def test_bad_policy_names_are_clear_errors(name: str) -> None:
    with pytest.raises(ValueError, match="policy"):
        make_policy(name)


def test_priority_comes_from_the_field_then_the_header_then_the_default() -> None:
    from proto import serving_pb2 as pb
    from scheduler_node.api.validation import DEFAULT_PRIORITY, InvalidField, _priority

    assert _priority(pb.GenerateRequest(prompt="x", priority=0), "90") == 0  # an explicit 0 wins
    assert _priority(pb.GenerateRequest(prompt="x"), "90") == 90
    assert _priority(pb.GenerateRequest(prompt="x"), None) == DEFAULT_PRIORITY
    with pytest.raises(InvalidField):
        _priority(pb.GenerateRequest(prompt="x"), "high")


def test_a_named_priority_comes_from_the_field_or_the_header_by_the_doors_ranges() -> None:
    from scheduler_node.api.validation import InvalidField, priority_from
    from settings.priority import PriorityConfig

    table = PriorityConfig(default_priority=45, priority_ranges="realtime=80-100,batch=20-40")
    assert priority_from(None, "realtime", table) == 90  # X-Priority: realtime, its range's middle
    assert priority_from("batch", "realtime", table) == 30  # the request's own field wins
    assert priority_from(None, "90", table) == 90  # numbers as before
    assert priority_from(None, None, table) == 45  # the door's default
    with pytest.raises(InvalidField) as err:
        priority_from("urgent", None, table)
    assert err.value.field == "priority" and "realtime=80-100" in str(err.value) and "'urgent'" in str(err.value)
    with pytest.raises(InvalidField, match="x-priority header"):
        priority_from(None, "realtime", PriorityConfig())  # no ranges: a name means nothing


class LoadSwitch(StepChoice):
    """The article's custom scheduler (seed 000, 6.3): by priority under load, else in arrival order."""

    def schedule(self) -> Policy:
        if self.load > 0.8:
            return self.priority_schedule()
        return self.fifo_schedule()


@pytest.mark.parametrize(("seats", "first"), [(4, "batch"), (10, "rt")])
def test_step_choice_orders_each_step_by_what_schedule_returns_under_its_load(seats: int, first: str) -> None:
    """One seat free: with 3 of 4 taken (load 0.75) arrival order holds (the earlier batch request takes it), with
    9 of 10 (load 0.9) the order is by priority (the realtime one does)."""
    policy = LoadSwitch()
    s = make(policy, num_blocks=64, seqs=seats)
    running = seats - 1
    for i in range(running):
        s.add(req(f"long{i}", 50, prompt=4, max_tokens=200, first=100 + 10 * i))
    step(s)
    assert len(s.running) == running and policy.load == pytest.approx(running / seats)
    s.add(req("batch", 30, at=1.0, first=900))
    s.add(req("rt", 90, at=2.0, first=950))
    assert first in step(s) and s.requests[first].status is Status.RUNNING
    other = "rt" if first == "batch" else "batch"
    assert s.requests[other].status is Status.WAITING


def test_load_is_the_larger_of_seats_taken_and_kv_blocks_in_use() -> None:
    policy = LoadSwitch()
    s = make(policy, num_blocks=9, seqs=8)
    assert policy.load == 0.0
    s.add(req("big", 50, prompt=64, max_tokens=200))  # 8 of 9 blocks, 1 of 8 seats
    step(s)
    assert policy.load == pytest.approx(s.blocks.usage) and policy.load > 0.8
    assert policy.current is policy.fifo_schedule()  # chosen as the step began, when nothing ran
    step(s)
    assert policy.current is policy.priority_schedule()


def test_a_schedule_that_returns_no_policy_is_a_clear_error() -> None:
    class Broken(StepChoice):
        def schedule(self) -> Policy:
            return "priority"  # type: ignore[return-value]

    s = make(Broken(), seqs=1)
    with pytest.raises(TypeError, match=r"Broken.schedule\(\) must return a policy"):
        s.schedule()


def test_step_choice_loads_by_dotted_path_and_the_fixed_orders_stay_stable() -> None:
    policy = make_policy("tests.scheduler_node.core.test_policy:LoadSwitch")
    assert isinstance(policy, LoadSwitch) and not policy.stable_order
    assert Policy.stable_order and PriorityPolicy.stable_order  # the default paths sort nothing per step
