"""The workers' view: a request goes out whole once, then only as what changed (its progress, blocks added,
blocks replaced, tokens where plans carry them); what the workers are to forget rides along with the next plan."""

from __future__ import annotations

import pytest

from proto.wire import CachedRequest, SamplingOptions, StepPlan
from scheduler_node.core.kv.block_ops import BlockOps
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.request import Request, StopConditions
from scheduler_node.core.worker_view import WorkerView

pytestmark = pytest.mark.unit

BS = 4  # tokens per block


def request(req_id: str, handle: int, prompt: int = 10) -> Request:
    req = Request(req_id, list(range(100, 100 + prompt)), SamplingOptions(temperature=0.0), StopConditions(20))
    req.handle = handle
    return req


def step(view: WorkerView, blocks: BlockTable, req: Request, first: int, n: int, step_id: int = 1) -> StepPlan:
    """A plan in which `req` computes n tokens from `first`; its blocks made writable first."""
    written = blocks.write(req.req_id, first, first + n)
    assert written is not None
    plan = StepPlan(step_id)
    view.add_to_plan(req, plan, first, n, blocks, written)
    view.finish_plan(plan, blocks.take_ops())
    return plan


def decoded(req: Request, token: int) -> None:
    """The result of its last step arrived: one more token, everything before it computed."""
    req.num_computed_tokens = req.num_tokens
    req.output_token_ids.append(token)


def test_a_request_goes_out_whole_once_then_as_its_diffs() -> None:
    view, blocks = WorkerView(tokens_in_plan=False), BlockTable(16, BS)
    req = request("a", 3)
    first = step(view, blocks, req, 0, 10)
    (new,) = first.new_requests
    assert (new.handle, new.block_ids, new.num_computed_tokens, new.num_scheduled_tokens) == (3, [0, 1, 2], 0, 10)
    assert not first.cached_requests and view.holds(3)
    decoded(req, 7)
    within = step(view, blocks, req, 10, 1, 2)  # position 10: still in block 2
    assert within.cached_requests == [CachedRequest(3, 10, 1)] and not within.new_requests
    decoded(req, 8)
    decoded(req, 9)
    across = step(view, blocks, req, 12, 1, 3)  # position 12: a new block
    assert across.cached_requests == [CachedRequest(3, 12, 1, (3,))]


def test_where_plans_carry_tokens_each_goes_out_once() -> None:
    view, blocks = WorkerView(tokens_in_plan=True), BlockTable(16, BS)
    req = request("a", 5)
    step(view, blocks, req, 0, 10)
    decoded(req, 7)
    assert step(view, blocks, req, 10, 1).cached_requests == [CachedRequest(5, 10, 1, (), (7,))]
    decoded(req, 8)
    decoded(req, 9)  # two steps' tokens since the last plan that named it
    assert step(view, blocks, req, 12, 1).cached_requests == [CachedRequest(5, 12, 1, (3,), (8, 9))]


def test_where_plans_carry_tokens_proposals_travel_with_the_tokens_before_them() -> None:
    """Speculation under PP: the stages learn the tokens a verify step accepted from the request's next plan, which
    may carry its next proposals too; both go out, each once."""
    view, blocks = WorkerView(tokens_in_plan=True), BlockTable(16, BS)
    req = request("a", 5)
    step(view, blocks, req, 0, 10)
    decoded(req, 7)

    def propose(first: int, drafts: tuple[int, ...]) -> list[CachedRequest]:
        written = blocks.write(req.req_id, first, first + 1 + len(drafts))
        assert written is not None
        plan = StepPlan(3)
        view.add_to_plan(req, plan, first, 1 + len(drafts), blocks, written, list(drafts))
        return plan.cached_requests

    assert propose(10, (40, 41)) == [CachedRequest(5, 10, 3, (3,), (7,), (40, 41))]  # position 12: a new block
    req.output_token_ids += [40, 8]  # one proposal accepted, then a token of its own
    req.num_computed_tokens = 12
    assert propose(12, (50,)) == [CachedRequest(5, 12, 2, (), (40, 8), (50,))]


def test_copy_on_write_and_moved_blocks_reach_only_tables_the_workers_hold() -> None:
    view, blocks = WorkerView(tokens_in_plan=False), BlockTable(16, BS)
    parent, child = request("p", 1, prompt=6), request("c", 2, prompt=6)
    step(view, blocks, parent, 0, 6)
    blocks.fork("p", "c", 6)  # the child shares both blocks, the last one half full
    decoded(parent, 7)
    plan = step(view, blocks, parent, 6, 1)  # writing into the shared last block copies it
    assert plan.block_copies == [(1, 2)], "the copy runs on the workers before the step"
    assert plan.block_updates == {1: [(1, 2)]}, "the parent's table, which the workers hold, changed"
    assert plan.cached_requests == [CachedRequest(1, 6, 1)]
    child.num_computed_tokens = 6  # a fork starts where its parent's prompt ends
    (new,) = step(view, blocks, child, 6, 1).new_requests
    assert new.block_ids == [0, 1], "a table that goes out whole carries no separate updates"
    assert view.replace_blocks({1: [(0, 9)], 99: [(0, 8)]}) == 2  # 99: a handle the workers do not hold
    later = StepPlan(5)
    view.finish_plan(later, BlockOps(swap_out=[(3, 0)], copy=[(4, 5)], swap_in=[(1, 6)]))
    assert later.block_updates == {1: [(0, 9)]}
    assert (later.swap_out, later.block_copies, later.swap_in) == ([(3, 0)], [(4, 5)], [(1, 6)])
    view.finish_plan(again := StepPlan(6), BlockOps())
    assert again.block_updates == {}, "sent once"


def test_forgotten_requests_ride_along_with_the_next_plan() -> None:
    view, blocks = WorkerView(tokens_in_plan=False), BlockTable(16, BS)
    done, preempted, never_sent = request("d", 1), request("p", 2, prompt=4), request("n", 3)
    step(view, blocks, done, 0, 10)
    step(view, blocks, preempted, 0, 4)
    assert not view.has_notices
    view.replace_blocks({1: [(0, 11)]})
    view.forget(done, preempted=False)
    view.forget(preempted, preempted=True)
    view.forget(never_sent, preempted=False)  # the workers never held it: nothing to tell them
    assert view.has_notices and not view.holds(1) and not view.holds(2)
    plan = StepPlan(9)
    view.finish_plan(plan, BlockOps())
    assert (plan.finished, plan.preempted, plan.block_updates) == ([1], [2], {})
    assert not view.has_notices
    back = step(view, blocks, preempted, 0, 4)  # a preempted request comes back whole
    assert [r.handle for r in back.new_requests] == [2]


def test_forget_all_holds_nothing_and_tells_nothing() -> None:
    view, blocks = WorkerView(tokens_in_plan=False), BlockTable(16, BS)
    req = request("a", 1)
    step(view, blocks, req, 0, 10)
    view.forget(request("b", 2), preempted=False)
    view.replace_blocks({1: [(0, 3)]})
    view.forget(req, preempted=True)
    view.forget_all()
    assert not view.holds(1) and not view.has_notices
    plan = StepPlan(2)
    view.finish_plan(plan, BlockOps())
    assert (plan.finished, plan.preempted, plan.block_updates) == ([], [], {})
