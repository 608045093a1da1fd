"""A step being built: its plan, its ledger entry and its limits (`Step`), and taking a request's tokens into them
(`PlanWriter`), the one way the running pass and admission both add to a plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from proto.wire import KVGrant, StepPlan, pack_int32
from scheduler_node.core.in_flight import SentPlan
from scheduler_node.core.kv.block_ops import Written
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.leases import KVLeases
from scheduler_node.core.request import Request
from scheduler_node.core.worker_view import WorkerView


@dataclass(slots=True)
class Step:
    """What `schedule()` hands its passes: the plan and its ledger entry, the tokens left to hand out (`budget`: the
    running pass takes from it, admission gets what is left), and what the step decided before the passes."""

    plan: StepPlan
    now: float
    budget: int
    seats: int  # requests this plan may hold
    floor: float  # prefill below this effective priority waits a step (`Admission.prefill_floor`)
    held: Callable[[int], bool] | None  # requests held by a plan in flight (None: no one is)
    excluded: Callable[[Request], bool] | None  # left out by the quarantine (None: no one is)
    sent: SentPlan = field(default_factory=SentPlan)


def prompt_blocks(req: Request, block_size: int) -> int:
    """The blocks of a prompt that a prefix hit may reuse, and a producer's KV lease holds (its last token is always
    computed)."""
    return (len(req.prompt_token_ids) - 1) // block_size


class PlanWriter:
    def __init__(self, view: WorkerView, blocks: BlockTable, leases: KVLeases) -> None:
        self.view = view
        self.blocks = blocks
        self.leases = leases

    def take(
        self,
        req: Request,
        n: int,
        samples: bool,
        plan: StepPlan,
        sent: SentPlan,
        written: Written,
        drafts: list[int] | None = None,
    ) -> None:
        """`req` computes `n` tokens in this plan, its last ones if `samples` (the step then samples its next
        token); its blocks are `written` already. With `drafts`, its last n - 1 tokens are these proposals, which
        the result accepts or not (`update` rolls the rejected ones back)."""
        first = req.num_computed_tokens
        self.view.add_to_plan(req, plan, first, n, self.blocks, written, drafts)
        req.num_computed_tokens = first + n
        if req.kv_lease and samples and not req.output_token_ids:  # a producer's prompt is computed by this plan
            blocks = self.blocks.blocks_of(req.req_id)[: prompt_blocks(req, self.blocks.block_size)]
            self.leases.grants.append(KVGrant(req.kv_lease, blocks))
        if samples:
            req.num_placeholders += 1  # this step samples a token the scheduler learns of later
        sent.add(req, n, samples, len(drafts) if drafts else 0)

    def take_decodes(self, reqs: list[Request], firsts: list[int], sent: SentPlan) -> int:
        """`take` of steady decodes, together: each computed one token within its own last block (no block added or
        copied) from `firsts[i]` and samples; the workers hold each one (one stage: they append its tokens
        themselves). None proposes or is a producer's (no drafts, no KV grant: the running pass leaves those to
        `take`). The pass advanced each request already (its computed tokens and placeholder); here the ledger
        takes them column by column (and both lists are emptied for the next ones), and the plan gets them packed
        when it is complete (`pack_decodes`). Returns how many: the tokens they take from the budget."""
        sent.add_decodes(reqs, firsts)
        taken = len(reqs)
        reqs.clear()
        firsts.clear()
        return taken

    @staticmethod
    def pack_decodes(plan: StepPlan, sent: SentPlan) -> None:
        """The plan's steady decodes, packed (StepPlan.decode_handles): two int32 arrays, not a record each."""
        if sent.decode_handles:
            plan.decode_handles = pack_int32(sent.decode_handles)
            plan.decode_computed = pack_int32(sent.decode_firsts)
