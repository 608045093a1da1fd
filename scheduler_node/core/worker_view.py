"""The workers' view: what the workers hold of each request, so that each plan carries only what changed.

A request the workers do not hold goes out whole (`NewRequest`); one they hold gets the blocks added since its
last plan (`CachedRequest`), and, where sampled tokens travel in plans (P > 1 stages), the tokens sampled since.
Blocks replaced in tables they hold (copy-on-write, compaction), and the requests they are to forget (finished,
aborted, preempted) ride along with the next plan.
"""

from __future__ import annotations

from proto.wire import CachedRequest, StepPlan
from scheduler_node.core.block_table import BlockOps
from scheduler_node.core.request import Request


class WorkerView:
    def __init__(self, tokens_in_plan: bool) -> None:
        self.tokens_in_plan = tokens_in_plan
        self._tokens_held: dict[str, int] = {}  # request -> tokens (prompt + output) the workers know of it
        self._new_blocks: dict[str, list[int]] = {}
        self._block_updates: dict[str, list[tuple[int, int]]] = {}
        self._finished: list[str] = []  # to forget with the next plan
        self._preempted: list[str] = []

    def holds(self, req_id: str) -> bool:
        return req_id in self._tokens_held

    @property
    def has_notices(self) -> bool:
        """Something to tell the workers even if no request runs."""
        return bool(self._finished or self._preempted)

    def add_to_plan(self, req: Request, plan: StepPlan, first: int, blocks: list[int], added: list[int]) -> None:
        """`req` computes from position `first` in this plan; `added` are its blocks appended for it."""
        held = self._tokens_held.get(req.req_id)
        if held is None:
            plan.new_requests.append(req.to_new_request(blocks))
        else:
            self._new_blocks.setdefault(req.req_id, []).extend(added)
            missing = req.output_token_ids[held - len(req.prompt_token_ids) :] if self.tokens_in_plan else []
            plan.cached_requests.append(CachedRequest(req.req_id, [], first, missing))
        self._tokens_held[req.req_id] = req.num_tokens

    def replace_blocks(self, updates: dict[str, list[tuple[int, int]]]) -> int:
        """(index, block) replacements in tables, for requests the workers hold; returns how many."""
        for req_id, changes in updates.items():
            self._block_updates.setdefault(req_id, []).extend(changes)
        return sum(len(c) for c in updates.values())

    def forget(self, req_id: str, preempted: bool) -> None:
        """The workers are to drop `req_id` (it finished, or was preempted and comes back as new)."""
        self._new_blocks.pop(req_id, None)
        self._block_updates.pop(req_id, None)
        if self._tokens_held.pop(req_id, None) is not None:
            (self._preempted if preempted else self._finished).append(req_id)

    def finish_plan(self, plan: StepPlan, ops: BlockOps) -> None:
        """Attach the diffs gathered since the last plan: new blocks, replacements, block work, notices."""
        for cached in plan.cached_requests:
            cached.new_block_ids = self._new_blocks.pop(cached.req_id, [])
        plan.block_updates = {r: u for r, u in self._block_updates.items() if r in self._tokens_held}
        self._block_updates = {}
        plan.swap_out, plan.block_copies, plan.swap_in = ops.swap_out, ops.copy, ops.swap_in
        plan.finished_req_ids, self._finished = self._finished, []
        plan.preempted_req_ids, self._preempted = self._preempted, []

    def forget_all(self) -> None:
        """The workers lost their state (a rank was lost; its replacement starts empty): nothing is held, nothing
        is pending, and there is nothing to tell them."""
        self._tokens_held.clear()
        self._new_blocks.clear()
        self._block_updates.clear()
        self._finished.clear()
        self._preempted.clear()
