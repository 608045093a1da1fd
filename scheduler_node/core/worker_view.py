"""The workers' view: what the workers hold of each request, so that each plan carries only what changed.

A request the workers do not hold goes out whole (`NewRequest`); one they hold gets where it stands, what this
step computes and the blocks added for it (`CachedRequest`), and, where sampled tokens travel in plans (P > 1
stages), the tokens sampled since. Blocks replaced in tables they hold (copy-on-write, compaction), and the requests
they are to forget (finished, aborted, preempted) ride along with the next plan. Requests are named by their
handles; nothing is kept or sent for a request that has nothing new.
"""

from __future__ import annotations

from proto.wire import CachedRequest, StepPlan
from scheduler_node.core.kv.block_ops import BlockOps, Written
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.lora_slots import LoraSlots
from scheduler_node.core.request import Request


class WorkerView:
    def __init__(self, tokens_in_plan: bool, max_loras: int = 1, max_cpu_loras: int = 0) -> None:
        self.tokens_in_plan = tokens_in_plan
        self.lora_slots = LoraSlots(max_loras, max_cpu_loras)  # a held request pins its adapter's slot
        self._tokens_held: dict[int, int] = {}  # handle -> tokens (prompt + output) the workers know of it
        self._block_updates: dict[int, list[tuple[int, int]]] = {}
        self._finished: list[int] = []  # to forget with the next plan
        self._preempted: list[int] = []

    def holds(self, handle: int) -> bool:
        return handle in self._tokens_held

    def plain_decodes(self) -> dict[int, int] | None:
        """What the scheduler's steady-decode path reads: the handles the workers hold (a dict to test membership
        in), or None where a decode carries more than its position (sampled tokens travel in plans)."""
        return None if self.tokens_in_plan else self._tokens_held

    @property
    def has_notices(self) -> bool:
        """Something to tell the workers even if no request runs."""
        return bool(self._finished or self._preempted)

    def add_to_plan(
        self,
        req: Request,
        plan: StepPlan,
        first: int,
        n: int,
        blocks: BlockTable,
        written: Written,
        drafts: list[int] | None = None,
    ) -> None:
        """`req` computes `n` tokens from position `first` in this plan; `written` is what that changed in its
        table in `blocks`. `drafts`: its last n - 1 tokens are these proposals (a request the workers hold)."""
        held = self._tokens_held.get(req.handle)
        if held is None:  # its table goes out whole, replacements included
            lora = None if req.lora is None else self.lora_slots.pin(req.lora)
            plan.new_requests.append(req.to_new_request(blocks.blocks_of(req.req_id), n, lora))
            self._tokens_held[req.handle] = req.num_tokens
            return
        if written.replaced:
            self._block_updates.setdefault(req.handle, []).extend(written.replaced)
        if self.tokens_in_plan:
            missing = tuple(req.output_token_ids[held - len(req.prompt_token_ids) :])
            self._tokens_held[req.handle] = req.num_tokens
            proposed = tuple(drafts) if drafts else ()
            plan.cached_requests.append(CachedRequest(req.handle, first, n, tuple(written.added), missing, proposed))
        elif drafts:
            added = tuple(written.added)
            plan.cached_requests.append(CachedRequest(req.handle, first, n, added, draft_token_ids=tuple(drafts)))
        elif written.added:
            plan.cached_requests.append(CachedRequest(req.handle, first, n, tuple(written.added)))
        else:
            plan.cached_requests.append(CachedRequest(req.handle, first, n))

    def replace_blocks(self, updates: dict[int, list[tuple[int, int]]]) -> int:
        """(index, block) replacements in tables, by handle, for requests the workers hold; returns how many."""
        for handle, changes in updates.items():
            self._block_updates.setdefault(handle, []).extend(changes)
        return sum(len(c) for c in updates.values())

    def forget(self, req: Request, preempted: bool) -> None:
        """The workers are to drop `req` (it finished, or was preempted and comes back as new)."""
        self._block_updates.pop(req.handle, None)
        if self._tokens_held.pop(req.handle, None) is not None:
            (self._preempted if preempted else self._finished).append(req.handle)
            if req.lora is not None:
                self.lora_slots.unpin(req.lora)

    def finish_plan(self, plan: StepPlan, ops: BlockOps) -> None:
        """Attach the diffs gathered since the last plan: replacements, block work, notices."""
        if self._block_updates:
            plan.block_updates = {h: u for h, u in self._block_updates.items() if h in self._tokens_held}
            self._block_updates = {}
        plan.swap_out, plan.block_copies, plan.swap_in = ops.swap_out, ops.copy, ops.swap_in
        if self._finished:
            plan.finished, self._finished = self._finished, []
        if self._preempted:
            plan.preempted, self._preempted = self._preempted, []

    def preempt_all(self) -> None:
        """The workers keep their state but the scheduler starts over (a failed step): they are to drop every
        request they hold with the next plan; notices already gathered still go out."""
        self._preempted.extend(self._tokens_held)
        self._tokens_held.clear()
        self.lora_slots.unpin_all()
        self._block_updates.clear()

    def forget_all(self) -> None:
        """The workers lost their state (a rank was lost; its replacement starts empty): nothing is held, nothing
        is pending, and there is nothing to tell them."""
        self._tokens_held.clear()
        self.lora_slots.unpin_all()
        self._block_updates.clear()
        self._finished.clear()
        self._preempted.clear()
