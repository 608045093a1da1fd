"""Interrupted steps: a lone worker skips the compute of plans in flight (before they start, or at a layer
boundary mid-forward), the scheduler rolls their requests back, and greedy output stays HF's token for token."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from minivllm.cluster import Cluster
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult, decode, encode
from scheduler_node.core.config import PreemptionMode, SchedulerConfig
from scheduler_node.core.policy import Policy, PriorityPolicy
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import Scheduler
from scheduler_node.engine.stand_in import StandInWorkers
from tests.support.engine import EngineRun, InterruptingWorkers, load_runner
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.ops import TINY_WORKER, StreamResult, Streams, greedy_ids, prompt_ids
from tests.support.plans import by_handle, scheduled

pytestmark = pytest.mark.e2e

BLOCK = 16


def test_interrupted_steps_keep_greedy_output_identical_to_hf(tiny_llama_dir: Path) -> None:
    """Now and then, right after a plan is sent, the engine interrupts every plan in flight (as it does for a
    request that outranks them); their requests are rolled back and scheduled again."""
    rng = random.Random(3)
    workers = InterruptingWorkers(rng)
    runner = load_runner(tiny_llama_dir, 14, BLOCK)
    run = EngineRun(
        runner, tokenizer_dir=tiny_llama_dir, transport=workers, max_num_batched_tokens=24, preemption_mode="recompute"
    )

    def sent(plan: StepPlan) -> None:
        run.plans.append(plan)
        if rng.random() < 0.35:  # once the engine awaits: every plan in flight, this one included
            asyncio.get_running_loop().call_soon(run.engine.interrupt_in_flight)

    workers.on_plan = sent
    with run:
        shared = [rng.randrange(3, 49152) for _ in range(2 * BLOCK)]  # a cached prefix: blocks registered per step
        prompts = [shared + [rng.randrange(3, 49152) for _ in range(k)] for k in (1, 9, 20)]
        prompts += [[rng.randrange(3, 49152) for _ in range(p)] for p in (5, 40, 17)]
        reqs = [run.add(p, m) for p, m in zip(prompts, (12, 7, 20, 25, 9, 14))]
        run.run_plans(6)
        reqs.append(run.add(shared + [7, 8, 9], 10))  # arrives while earlier prefills may be interrupted
        run.run()
        assert workers.mid_forward > 0 and workers.before_start > 0, "both kinds of interruption must be tried"
        assert run.scheduler.counters.interrupted_steps > 0
        assert run.scheduler.blocks.num_free == 14
    hf = load_hf(tiny_llama_dir)
    for req in reqs:
        assert len(req.output) == req.max_tokens
        assert_teacher_forced(hf, req.prompt, req.output)


def _req(req_id: str, priority: int, prompt: int = 20, at: float = 0.0) -> Request:
    start = 1000 * (1 + sum(map(ord, req_id)))  # prompts share no prefix
    tokens = list(range(start, start + prompt))
    r = Request(req_id, tokens, SamplingOptions(temperature=0.0), StopConditions(30), priority)
    r.arrival_time = at
    return r


def _scheduler(policy: Policy) -> Scheduler:
    config = SchedulerConfig(block_size=BLOCK, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)
    return Scheduler(config, 64, policy=policy, mode=ExecutionMode.for_world(1, 1, True), clock=lambda: 5.0)


def test_undo_puts_requests_back_where_they_were() -> None:
    s = _scheduler(PriorityPolicy())
    for i in range(3):
        s.add(_req(f"b{i}", 30))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, {h: [9] for h in first.num_scheduled_tokens}))
    before = {r.req_id: (r.num_computed_tokens, r.num_placeholders) for r in s.running}
    in_flight = [s.schedule(), s.schedule()]  # async: two decode steps sent, results unknown
    assert all(len(p.num_scheduled_tokens) == 3 for p in in_flight)
    rt = _req("rt", 90, at=4.0)
    s.add(rt)
    assert s.may_interrupt(rt, in_flight)
    for plan in in_flight:
        assert s.update(plan, StepResult(plan.step_id, {}, interrupted=True)) == []
    assert {r.req_id: (r.num_computed_tokens, r.num_placeholders) for r in s.running} == before
    assert s.counters.interrupted_steps == 2
    plan = s.schedule()
    assert scheduled(s, plan) == {"b0": 1, "b1": 1, "b2": 1, "rt": 20}
    assert [c.num_computed_tokens for c in plan.all_cached_requests] == [20, 20, 20]  # the workers' view agrees


def test_only_a_request_that_outranks_every_one_in_flight_interrupts() -> None:
    for policy, priority, expected in (
        (Policy(), 90, False),
        (PriorityPolicy(), 33, False),
        (PriorityPolicy(), 90, True),
    ):
        s = _scheduler(policy)
        s.add(_req("b", 30))
        plan = s.schedule()
        assert s.may_interrupt(_req("new", priority), [plan]) is expected


def test_plans_that_swap_out_are_not_undone() -> None:
    assert not Scheduler.can_undo([StepPlan(2, swap_out=[(1, 2)])])
    assert Scheduler.can_undo([StepPlan(1, preempted=[7]), StepPlan(3, swap_in=[(0, 1)])])


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_a_realtime_request_interrupts_the_resumption_of_the_one_it_displaced(preemption_mode: str) -> None:
    """Realtime requests back to back at the seat cap: the next one arrives while the batch request the last one
    displaced resumes (swapped back in, or recomputed), and skips that step instead of waiting for it. Stand-in
    workers check the scheduler's view of what they hold at every step, interrupted ones included."""
    config = SchedulerConfig(
        block_size=BLOCK,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=1,
        preemption_mode=PreemptionMode(preemption_mode),
    )
    s = Scheduler(config, 16, PriorityPolicy(), ExecutionMode.for_world(1, 1, True), num_host_blocks=16)
    workers = StandInWorkers(16, 16, block_size=BLOCK)
    in_flight: list[StepPlan] = []

    def send() -> None:
        in_flight.append(s.schedule())

    def answer(skip: bool = False) -> None:
        plan = in_flight.pop(0)
        s.update(plan, workers.execute(plan, skip=skip))

    s.add(_req("b", 30))
    send()
    answer()
    s.add(_req("rt1", 90, prompt=8))
    send()  # rt1 displaces b
    assert s.requests["b"].status is Status.PREEMPTED
    while "rt1" in s.requests:
        send()
        answer()
    send()  # b resumes
    resumption = in_flight[-1]
    assert scheduled(s, resumption).keys() == {"b"} and (resumption.swap_in or resumption.new_requests)
    rt2 = _req("rt2", 90, prompt=8)
    s.add(rt2)
    assert s.may_interrupt(rt2, in_flight) and s.can_undo(in_flight)
    while in_flight:
        answer(skip=True)
    assert s.counters.interrupted_steps >= 1
    send()
    assert "rt2" in scheduled(s, in_flight[-1])
    while s.has_work:
        send()
        answer()
    while in_flight:
        answer()
    assert not s.requests and s.blocks.num_free == 16


def test_higher_class_prefill_runs_without_lower_class_prefill() -> None:
    s = _scheduler(PriorityPolicy())
    s.add(_req("b0", 30))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, by_handle(s, {"b0": [9]})))
    s.add(_req("b1", 30, prompt=40))
    s.add(_req("rt", 90, prompt=8, at=1.0))
    plan = s.schedule()
    assert scheduled(s, plan) == {"b0": 1, "rt": 8}  # b0 decodes; b1's prefill waits one step
    s.update(plan, StepResult(plan.step_id, by_handle(s, {"b0": [9], "rt": [9]})))
    assert scheduled(s, s.schedule()) == {"b0": 1, "rt": 1, "b1": 40}


def test_a_worker_interrupted_mid_forward_restores_its_progress(tiny_llama_dir: Path) -> None:
    runner = load_runner(tiny_llama_dir, 8, BLOCK)
    s = _scheduler(Policy())
    prompt = list(range(3, 30))
    s.add(Request("r", prompt, SamplingOptions(temperature=0.0), StopConditions(4)))
    plan = decode(encode(s.schedule()))
    assert isinstance(plan, StepPlan)
    hook = runner.model.layers[0].register_forward_hook(lambda *_: runner.interrupts.add(plan.step_id, plan.step_id))
    result = runner.execute(plan)
    hook.remove()
    assert result.interrupted and not result.sampled
    assert [runner.computed_tokens(h) for h in runner.batch.states] == [0]
    s.update(plan, result)
    req = s.requests["r"]
    assert req.num_computed_tokens == 0 and req.num_placeholders == 0
    again = decode(encode(s.schedule()))  # the same prefill, not interrupted this time
    assert isinstance(again, StepPlan) and scheduled(s, again) == {"r": len(prompt)}
    s.update(again, runner.execute(again))
    assert len(req.output_token_ids) == 1
    assert_teacher_forced(load_hf(tiny_llama_dir), prompt, req.output_token_ids)


BATCH_TOKENS = 400  # long enough that the batch is still decoding while realtime requests arrive, on a busy CI
REALTIME_TRIES = 10


def test_a_realtime_request_interrupts_a_real_worker(tiny_llama_dir: Path) -> None:
    """Over ZMQ: the scheduler interrupts the plans in flight for a priority-90 arrival, the worker skips them,
    and every request, interrupted or not, still gets HF's greedy tokens.

    The tiny model's steps take milliseconds, so an Interrupt can reach the worker after the steps it names have
    finished (nothing is skipped then): realtime requests keep arriving until one step was actually skipped."""
    args = ["--scheduling-policy", "priority", "--max-num-batched-tokens", "16", "--dtype", "float32"]  # HF at 1e-3
    cluster = Cluster(tiny_llama_dir, args, TINY_WORKER)
    control = pb_grpc.ControlStub(cluster.channel)
    realtime_prompts: list[list[int]] = []
    realtime: list[StreamResult] = []
    try:
        cluster.wait_serving()
        stub = pb_grpc.GenerationStub(cluster.channel)
        batch = Streams(stub, [greedy_ids(prompt_ids(i, 40), BATCH_TOKENS, priority=30) for i in range(6)])
        batch.wait_all_started()
        while len(realtime) < REALTIME_TRIES and not control.GetStats(pb.GetStatsRequest()).interrupted_steps:
            assert not any(r.finish_reason for r in batch.results), "the batch must still run when realtime arrives"
            realtime_prompts.append(prompt_ids(99 + len(realtime), 8))
            realtime += Streams(stub, [greedy_ids(realtime_prompts[-1], 5, priority=90)]).join()
        results = batch.join() + realtime
        stats = control.GetStats(pb.GetStatsRequest(), timeout=10)
    finally:
        codes = cluster.stop()
    assert codes == [0, 0], cluster.logs()
    assert "interrupts steps" in (cluster.log_dir / "scheduler.log").read_text(), cluster.logs()
    assert stats.interrupted_steps >= 1, f"no step skipped in {len(realtime)} realtime arrivals"
    hf = load_hf(tiny_llama_dir)
    prompts = [prompt_ids(i, 40) for i in range(6)] + realtime_prompts
    for prompt, result, wanted in zip(prompts, results, [BATCH_TOKENS] * 6 + [5] * len(realtime), strict=True):
        assert result.finish_reason == "length" and len(result.tokens) == wanted
        assert_teacher_forced(hf, prompt, result.tokens)


def test_only_a_lone_worker_with_plans_that_can_be_undone_is_interrupted() -> None:
    """Scheduler.interruptible: the one answer to "may these plans be interrupted", which may_interrupt and the
    engine ask."""
    lone = _scheduler(PriorityPolicy())
    assert lone.interruptible([StepPlan(1), StepPlan(2)])
    assert not lone.interruptible([])
    assert not lone.interruptible([StepPlan(1), StepPlan(2, swap_out=[(1, 2)])])
    config = SchedulerConfig(block_size=BLOCK, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)
    for tp, pp in ((2, 1), (1, 2)):
        world = Scheduler(config, 64, policy=PriorityPolicy(), mode=ExecutionMode.for_world(tp, pp, True))
        world.add(_req("b", 30))
        plan = world.schedule()
        assert not world.interruptible([plan]) and not world.may_interrupt(_req("rt", 90), [plan])
