"""The running pass of a step: running requests in policy order catch up under the budget and the seats, the least
valued of them preempted while blocks are short.

It runs once per running request per step, so its Python work grows with what changed, not with what runs: a
steady decode (one token within its own last block, held by the workers; not one that may propose this step, nor
a disaggregated prefill's, whose plan may grant its KV lease) costs a membership test and the block table's
in-place test (`BlockTable.writes_in_place`), and enters the plan and the ledger with the other steady decodes,
column by column (`PlanWriter.take_decodes`), packed (two int32 arrays in the plan, `StepPlan.decode_handles`), not
as a record of its own. Such a decode that starts a block (or copies a shared one) is taken alone, in the loop too;
anything else takes the general way (`_take_one`: proposals, prompt chunks, preemption).
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_node.core.capacity import Capacity
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.policy import Policy
from scheduler_node.core.preemption import Preemption
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request, Status
from scheduler_node.core.speculator import Speculator
from scheduler_node.core.step import PlanWriter, Step
from scheduler_node.core.worker_view import WorkerView

_NO_HANDLES: frozenset[int] = frozenset()


class RunningPass:
    def __init__(
        self,
        queues: RequestQueues,
        policy: Policy,
        blocks: BlockTable,
        view: WorkerView,
        writer: PlanWriter,
        preemption: Preemption,
        speculator: Speculator | None,
        capacity: Capacity,
    ) -> None:
        self.queues = queues
        self.policy = policy
        self.blocks = blocks
        self.view = view
        self.writer = writer
        self.preemption = preemption
        self.speculator = speculator
        self.capacity = capacity

    def run(self, step: Step) -> bool:
        """Take the running requests' tokens into the step, `step.budget` what is left after; returns whether
        anyone was preempted."""
        running = self.queues.running
        order = list(running) if self.policy.stable_order else self.policy.order_running(running, step.now)
        spec = self.speculator
        # With the policy off (a big batch) speculation costs nothing per request: no proposal is even considered.
        proposing = spec if spec is not None and spec.active else None
        held, excluded, seats, budget, sent = step.held, step.excluded, step.seats, step.budget, step.sent
        # What the loop reads for every request is looked up once, here (len too: a local is found faster).
        live, size, in_place, scheduled = Status.RUNNING, len, self.blocks.writes_in_place, sent.requests
        plain = self.view.plain_decodes() or _NO_HANDLES  # None: sampled tokens travel in plans
        # Steady decodes (and their computed tokens before this step), taken together before anything else is taken
        decodes: list[Request] = []
        firsts: list[int] = []
        add_decode, add_first = decodes.append, firsts.append
        # `room`: requests the loop may take before it looks at the budget and the seats again (a steady decode
        # counts it down, any other take sets it to 0). The gathered decodes' tokens leave the budget once taken.
        room, preempted, writer = 0, False, self.writer
        for req in order if held is None and excluded is None else _eligible(order, held, excluded):
            if room <= 0:
                pending = len(decodes)
                room = min(budget - pending, seats - len(scheduled) - pending)
                if room <= 0:
                    break
            if req.status is not live:
                continue  # preempted for a request before it in this step
            first = req.num_computed_tokens
            # `Request.tokens_to_schedule`, inline: this line runs for every running request at every step
            num_out = size(req.output_token_ids) + req.num_placeholders
            todo = size(req.prompt_token_ids) + num_out - first if num_out < req.stop.max_tokens else 0
            if todo == 1 and req.handle in plain and (proposing is None or req.spec is None) and not req.kv_lease:
                if in_place(req.req_id, first):
                    # `PlanWriter.take` of a steady decode, its request's part inline: it computes one token and
                    # samples it (a token the scheduler learns of later); the plan and the ledger get them together
                    req.num_computed_tokens = first + 1
                    req.num_placeholders += 1
                    add_decode(req)
                    add_first(first)
                    room -= 1
                    continue
                room = 0
                written = self.blocks.write(req.req_id, first, first + 1)  # starts a block, or copies a shared one
                if written is not None:  # taken alone (None: no block is free, the general way)
                    if decodes:
                        budget -= writer.take_decodes(decodes, firsts, sent)
                    writer.take(req, 1, True, step.plan, sent, written)
                    budget -= 1
                    continue
            room = 0
            if decodes:
                budget -= writer.take_decodes(decodes, firsts, sent)
            step.budget = budget
            preempted |= self._take_one(req, todo, order, step)
            budget = step.budget
        if decodes:
            budget -= writer.take_decodes(decodes, firsts, sent)
        step.budget = budget
        return preempted

    def _take_one(self, req: Request, todo: int, order: list[Request], step: Step) -> bool:
        """The general way for a running request with `todo` tokens to compute: a decode that proposes, a prompt
        chunk, a decode short of blocks (or one that is not steady: the workers do not hold it, a producer's).
        Takes from `step.budget`; returns whether anyone was preempted for it."""
        first, plan, sent = req.num_computed_tokens, step.plan, step.sent
        if todo <= 0 or (todo > 1 and step.budget > 1 and self.policy.effective_priority(req, step.now) < step.floor):
            return False  # nothing to compute now, or a prefill chunk below the floor
        if todo == 1 and self._take_proposals(req, step):
            return False
        n = min(todo, step.budget)
        written, preempted = self.blocks.write(req.req_id, first, first + n), False
        if written is None:  # blocks are short: it may preempt the less valued ones after it
            later = order[order.index(req) + 1 :]
            written, preempted = self.preemption.write_or_preempt(req, first, n, later, step.held, step.now)
        if written is not None:
            self.writer.take(req, n, n == todo, plan, sent, written)
            step.budget -= n
        return preempted

    def _take_proposals(self, req: Request, step: Step) -> bool:
        """A decode of a request that speculates: its proposals (if blocks allow) in this plan, or none while its
        last token is in flight. False: it decodes plainly."""
        spec = self.speculator
        if spec is None or not spec.active or req.spec is None or not self.view.holds(req.handle):
            return False
        drafts = spec.drafts(req, spec.room(req, step.budget, self.capacity.max_model_len))
        if drafts is None:
            return True  # it speculates: its next plan waits for this one's tokens
        if not drafts:
            return False
        first = req.num_computed_tokens
        written = self.blocks.write(req.req_id, first, first + 1 + len(drafts))
        if written is None:  # proposals never preempt anyone: without blocks, a plain decode
            return False
        self.writer.take(req, 1 + len(drafts), True, step.plan, step.sent, written, drafts)
        step.budget -= 1 + len(drafts)
        return True


def _eligible(
    order: list[Request], held: Callable[[int], bool] | None, excluded: Callable[[Request], bool] | None
) -> list[Request]:
    """Those of `order` the pass may take: none held by a plan in flight, none left out by the quarantine (a suspect
    outside its own step, or another request in a suspect's step). Neither changes during the pass."""
    if held is not None:
        order = [r for r in order if not held(r.handle)]
    if excluded is not None:
        order = [r for r in order if not excluded(r)]
    return order
