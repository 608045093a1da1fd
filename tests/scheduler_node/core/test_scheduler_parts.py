"""The scheduler's parts: the running pass's steady-decode path builds the plans and ledgers the general path
would (also with speculation, its policy turning on and off with the batch, and a disaggregated prefill's KV grant),
and the parts `Scheduler` composes share its one block table and one set of queues."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from proto.wire import ExecutionMode, SamplingOptions, StepPlan, StepResult
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.in_flight import SentPlan
from scheduler_node.core.request import Request, StopConditions
from scheduler_node.core.scheduler import RequestOutput, Scheduler
from scheduler_node.core.speculative import SpecState
from settings.speculative import SpeculativeConfig

pytestmark = pytest.mark.unit

# (step it arrives at, id, prompt length, max_tokens, forks): decodes that cross blocks, a fork whose parent's
# first decode copies the shared last block, a long prompt chunked among decodes, more than the blocks hold.
ARRIVALS = [
    (0, "a", 5, 30, 0),
    (0, "b", 7, 26, 0),
    (0, "fork", 6, 18, 1),
    (2, "long", 30, 9, 0),
    (4, "c", 3, 25, 0),
    (9, "d", 11, 20, 0),
]
# With speculation: a producer of disaggregated prefill (its 22-token prompt's last chunk is one token within its
# last block, the shape of a steady decode, and that plan grants its lease), and more requests than the policy
# speculates for at first.
SPEC_ARRIVALS = [*ARRIVALS, (0, "producer", 22, 1, 0)]
LEASE = bytes(range(16))


def make(fast: bool, spec: bool) -> tuple[Scheduler, list[int]]:
    """A scheduler of two plans in flight (async scheduling), tight on blocks; `fast=False` turns the steady-decode
    path off; `spec`: n-gram speculation, off while more than 4 requests run. Also a list that counts the decodes
    the steady path took."""
    speculative = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=4) if spec else None
    cfg = SchedulerConfig(
        block_size=8, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=256, speculative=speculative
    )
    s = Scheduler(cfg, 12, mode=ExecutionMode.for_world(1, 1, True))
    taken: list[int] = []
    take_decodes = s.writer.take_decodes

    def counted(reqs: list[Request], firsts: list[int], sent: Any) -> int:
        taken.append(len(reqs))
        return take_decodes(reqs, firsts, sent)

    s.writer.take_decodes = counted  # type: ignore[method-assign]
    if not fast:
        s.view.plain_decodes = lambda: None  # type: ignore[method-assign]
    return s, taken


def arrive(s: Scheduler, step: int, spec: bool) -> None:
    for at, rid, prompt_len, max_tokens, forks in SPEC_ARRIVALS if spec else ARRIVALS:
        if at == step:
            # With speculation the prompts repeat (the n-gram proposer finds matches), and the workers' tokens too.
            prompt = [10 + (i % 3 if spec else (i * 7 + len(rid)) % 50) for i in range(prompt_len)]
            stop = StopConditions(max_tokens, frozenset())
            req, *children = (
                Request(req_id, list(prompt), SamplingOptions(0.0), stop, spec=SpecState() if spec else None)
                for req_id in [rid, *(f"{rid}-{k}" for k in range(1, forks + 1))]
            )
            if rid == "producer":  # it does not speculate: its last chunk would be a steady decode but for its lease
                req.kv_lease, req.spec = LEASE, None
            s.add(req, forks=children)


def ledger(s: Scheduler, plan: StepPlan) -> tuple[list[Any], ...]:
    """What the in-flight ledger holds of a plan (nothing for a plan of notices only), requests by handle."""
    sent = s.in_flight._plans.get(plan.step_id, SentPlan())
    handles = [r.handle for r in sent.requests]
    return handles, sent.tokens, sent.ends, sent.samples, sent.runs, sent.drafts


def result(s: Scheduler, plan: StepPlan, spec: bool) -> StepResult:
    """What a worker returns: a token for each request the plan samples, from its handle and the step; with
    speculation, tokens that repeat, and its first proposal accepted on odd steps."""
    handles, _, _, samples, _, drafts = ledger(s, plan)
    if not spec:
        tokens = {h: [100 + (h * 31 + plan.step_id) % 57] for h, yes in zip(handles, samples) if yes}
        return StepResult(plan.step_id, tokens)
    proposed = {c.handle: list(c.draft_token_ids) for c in plan.cached_requests}
    tokens = {}
    for h, yes, d in zip(handles, samples, drafts):
        if yes:
            accepted = proposed[h][:1] if d and plan.step_id % 2 else []
            tokens[h] = [*accepted, 10 + (h + plan.step_id) % 3]
    return StepResult(plan.step_id, tokens)


def whole(plan: StepPlan) -> StepPlan:
    """The plan with its packed steady decodes as cached requests, all by handle: what the worker is told, the same
    whether the steady path packed a decode or the general path made its record (the order is not the worker's
    concern; the ledger keeps the loop's)."""
    cached = sorted(plan.all_cached_requests, key=lambda c: c.handle)
    return msgspec.structs.replace(plan, cached_requests=cached, decode_handles=b"", decode_computed=b"")


def run(fast: bool, spec: bool = False) -> tuple[list[Any], list[int], int]:
    """Every plan, ledger and output of the scenario, the decodes the steady path took, and the preemptions."""
    s, taken = make(fast, spec)
    trace: list[Any] = []
    in_flight: list[StepPlan] = []
    for step in range(400):
        arrive(s, step, spec)
        plan = s.schedule()
        if plan.has_work:
            assert s.scheduled_tokens(plan) == plan.total_tokens  # the ledger's count, what the engine reads
            in_flight.append(plan)
            trace.append((whole(plan), ledger(s, plan)))
        if len(in_flight) == 2 or (in_flight and not plan.has_work):
            head = in_flight.pop(0)
            outputs = s.update(head, result(s, head, spec))
            trace.append([(o.request.req_id, o.new_token_ids, o.finish_reason) for o in outputs])
        if step > 10 and not s.has_work and not in_flight:
            break
    assert not s.requests, "the scenario ends with every request finished"
    return trace, taken, s.num_preemptions


def test_steady_decodes_make_the_plans_the_general_path_makes() -> None:
    fast, taken, preemptions = run(fast=True)
    general, not_taken, _ = run(fast=False)
    assert fast == general
    assert sum(taken) > 100 and not not_taken  # the steady path ran, and only where it was on
    # and its decodes went out packed: the plans of a run with the steady path on carry them so
    s, _ = make(fast=True, spec=False)
    arrive(s, 0, spec=False)
    first, second, third = s.schedule(), s.schedule(), s.schedule()  # prompts, then decodes (two plans ahead)
    handles = [r.handle for r in s.running]
    assert len(first.new_requests) == 3 and not first.num_decodes and not second.cached_requests
    assert second.decodes() == (handles, [5, 7, 6])  # a, b, fork: each its prompt computed
    assert third.decodes() == ([handles[0], handles[2]], [6, 7])  # b's next token starts a block: a record
    records = [(c.handle, c.num_computed_tokens, c.new_block_ids) for c in third.cached_requests]
    assert records == [(handles[1], 8, (3,))]
    assert preemptions > 0  # blocks ran short: decodes and preemption met


def test_steady_decodes_make_the_plans_the_general_path_makes_with_speculation_and_kv_grants() -> None:
    fast, taken, _ = run(fast=True, spec=True)
    general, _, _ = run(fast=False, spec=True)
    assert fast == general
    plans = [t[0] for t in fast if isinstance(t, tuple)]
    # (fewer than without speculation: while a request speculates, plans run one at a time)
    assert sum(taken) > 8, "the steady path ran (speculation off for a big batch, and for those that opt out)"
    assert any(c.draft_token_ids for p in plans for c in p.cached_requests), "requests proposed"
    granting = [p for p in plans if p.kv_grants]
    assert [g.lease for p in granting for g in p.kv_grants] == [LEASE], "the producer's last chunk granted its lease"
    last_chunk = [c for c in granting[0].cached_requests if c.num_computed_tokens == 21]
    assert [(c.num_scheduled_tokens, c.new_block_ids) for c in last_chunk] == [(1, ())], "a steady decode's shape"


def test_the_parts_hold_the_one_table_and_the_one_set_of_queues_through_a_restart() -> None:
    """Each part is handed the scheduler's state once, at construction: a restart (a lost rank) empties the block
    table in place, so every part still works on the table and the queues the scheduler reports."""
    s, _ = make(fast=True, spec=False)
    arrive(s, 0, spec=False)
    s.schedule()
    assert s.requeue_all() == 3
    tables = [s.capacity.blocks, s.preemption.blocks, s.claims.blocks, s.admission.blocks, s.running_pass.blocks]
    tables += [s.results.blocks, s.writer.blocks, s.migrations.blocks]
    assert all(t is s.blocks for t in tables) and s.blocks.num_free == 12
    queues = [s.capacity.queues, s.preemption.queues, s.claims.queues, s.admission.queues, s.running_pass.queues]
    assert all(q is s.queues for q in [*queues, s.results.queues, s.migrations.queues])
    plan = s.schedule()  # every request starts over, on the emptied table
    assert {r.handle for r in plan.new_requests} == {s.requests[rid].handle for rid in ("a", "b", "fork")}
    assert s.blocks.num_free < 12 and RequestOutput.__module__ == "scheduler_node.core.results"
