"""The scheduler: one rule for prefill, chunked prefill, prefix hits, resumption and decode.

Each request has `num_computed_tokens` and `num_tokens`; every step hands out tokens from a budget
(`max_num_batched_tokens`, `max_num_seqs`) so that the first catches up with the second. When blocks run out,
the policy's least valued running request is preempted (recompute, swap, or whichever is cheaper) and goes
back to waiting.

How plans flow (the execution mode) is decided once from the world: with P > 1 pipeline stages the engine keeps
up to P plans in flight, each on requests that no other in-flight plan holds, and a request comes back only once
its result is applied, so the scheduler knows the token it sampled and hands it to every rank with the plan. Two
helpers keep the rest: the workers' view (what each plan must tell the workers) and the in-flight ledger (what
each plan did, to apply or undo it).

This module is the step loop. The scheduler's other ideas are its bases, one module each: its state and queues
(scheduler_state.py), preemption (preemption.py), admission (admission.py) and applying results (results.py);
speculation is the Speculator's (speculator.py).

A step's Python work grows with what changed, not with what runs: a steady decode (one token, within its own
last block, held by the workers) is one membership test and one block check in the loop, and is taken into the
plan and the ledger with the other decodes, column by column (`_take_decodes`), and goes out packed with them
(two int32 arrays in the plan, `StepPlan.decode_handles`), not as a record of its own.
"""

from __future__ import annotations

import time

from proto.wire import StepPlan
from scheduler_node.core import block_relocation
from scheduler_node.core.admission import Admission
from scheduler_node.core.block_table import UNCHANGED, Written
from scheduler_node.core.in_flight import SentPlan
from scheduler_node.core.request import Request, Status
from scheduler_node.core.results import RequestOutput, Results
from scheduler_node.core.scheduler_state import PreemptionCosts, SchedulerCounters

__all__ = ["PreemptionCosts", "RequestOutput", "Scheduler", "SchedulerCounters"]


class Scheduler(Admission, Results):
    """The step loop: `schedule` builds a plan under the one rule, `update` applies its result (results.py);
    admission, preemption and the state they share are the bases' (admission.py, preemption.py,
    scheduler_state.py)."""

    def schedule(self) -> StepPlan:
        self._step_id += 1
        now = self.clock()
        self._maybe_compact()
        plan = StepPlan(self._step_id)
        sent = SentPlan()
        budget = self.config.max_num_batched_tokens
        self._displace_for_priority(now, budget)
        floor = self._prefill_floor(now)
        preempted = False
        order = list(self.running) if self.policy.stable_order else self.policy.order_running(self.running, now)
        spec = self.speculator
        if spec is not None:
            spec.begin_step(self.running)
            if spec.wait:
                budget = 0  # speculation runs one plan at a time, every request in it (speculator.py)
        seats = self._seats_per_plan()  # after `begin_step`: speculation's lockstep gives one plan every seat
        # Speculating requests are held while their plan is in flight (their next tokens are not known before).
        holds = self.mode.disjoint_plans or (spec is not None and self.in_flight.holds_any)
        held = self.in_flight.held if holds else None
        excluded = self.quarantine.excluded()  # None unless a step failed with nobody blamed
        # With the policy off (a big batch) speculation costs nothing per request: no proposal is even considered.
        proposing = spec if spec is not None and spec.active else None
        # The loop runs once per running request per step: what it calls is looked up once, here.
        running, take = Status.RUNNING, self._take
        write, scheduled, unchanged = self.blocks.write, sent.requests, UNCHANGED
        tables, refs, bs = self.blocks.decode_view()
        # Steady decodes (one token, within the request's own last block, held by the workers) are gathered here
        # and taken together (`_take_decodes`) before anything else is taken, so the plan keeps the loop's order.
        # Not a steady decode: one that may propose (`proposing`), or a producer's (`kv_lease`), whose plan may
        # grant its lease (`_take`).
        decodes: list[Request] = []
        firsts: list[int] = []  # theirs: computed tokens before this step
        plain = self.view.plain_decodes()
        # Requests the loop may still take before it looks at the budget and the seats again: a steady decode
        # counts it down; any other take sets it to 0, so the next request looks again.
        room = 0
        for i, req in enumerate(order):
            if room <= 0:
                room = min(budget, seats - len(scheduled) - len(decodes))
                if room <= 0:
                    break
            if req.status is not running or (held is not None and held(req.handle)):
                continue  # preempted for a request before it in this step, or in a plan in flight
            if excluded is not None and excluded(req):
                continue  # a suspect outside its own step, or another request in a suspect's step
            first = req.num_computed_tokens
            # `_tokens_to_schedule`, inline: this line runs for every running request at every step
            num_out = len(req.output_token_ids) + req.num_placeholders
            todo = len(req.prompt_token_ids) + num_out - first if num_out < req.stop.max_tokens else 0
            if (
                todo == 1
                and plain is not None
                and req.handle in plain
                and (proposing is None or req.spec is None)
                and not req.kv_lease
            ):
                # `write(req.req_id, first, first + 1) is unchanged`, its first test inline (the common case)
                table = tables.get(req.req_id)
                block = first // bs
                written: Written | None
                if table is not None and block < len(table) and refs[table[block]] == 1:
                    written = unchanged
                else:
                    written = write(req.req_id, first, first + 1)  # None when no block is free
                if written is unchanged:
                    # `_take` of a steady decode, its request's part inline: it computes one token and samples it
                    # (a token the scheduler learns of later); the plan and the ledger get them together later
                    # (`_take_decodes`), before anything else is taken, so the plan keeps the loop's order
                    req.num_computed_tokens = first + 1
                    req.num_placeholders += 1
                    decodes.append(req)
                    firsts.append(first)
                    budget -= 1
                    room -= 1
                    continue
                room = 0
                if written is not None:  # a decode that starts a block (or copies a shared one): taken alone
                    if decodes:
                        self._take_decodes(decodes, firsts, plan, sent)
                        decodes, firsts = [], []
                    take(req, 1, True, plan, sent, written)
                    budget -= 1
                    continue
            room = 0
            n = todo if todo <= budget else budget
            if n <= 0 or (n > 1 and self.policy.effective_priority(req, now) < floor):
                continue
            if decodes:
                self._take_decodes(decodes, firsts, plan, sent)
                decodes, firsts = [], []
            drafts: list[int] | None = []
            if proposing is not None and todo == 1 and req.spec is not None and self.view.holds(req.handle):
                drafts = proposing.drafts(req, proposing.room(req, budget, self.max_model_len))
                if drafts is None:
                    continue  # it speculates: its next plan waits for this one's tokens
                if drafts:
                    written = write(req.req_id, first, first + 1 + len(drafts))
                    if written is not None:  # proposals never preempt anyone: without blocks, a plain decode
                        take(req, 1 + len(drafts), True, plan, sent, written, drafts)
                        budget -= 1 + len(drafts)
                        continue
                    drafts = []
            while (written := write(req.req_id, first, first + n)) is None:
                later = self._same_pool(req, order[i + 1 :])  # the less valued ones that hold blocks it can use
                victim = self._pick_victim([r for r in later if self._schedulable(r, held)], now)
                if victim is None and held is not None and any(self._running_in_flight(r, held) for r in later):
                    # Those it could displace are in plans in flight: it waits for their results instead of
                    # preempting itself (two big requests doing that to each other would take turns forever).
                    break
                victim = victim or req
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                take(req, n, n == todo, plan, sent, written)
                budget -= n
        if decodes:
            self._take_decodes(decodes, firsts, plan, sent)
        if not preempted or not self.running:  # a request that preempted itself leaves the cache to the others
            self._admit(budget, seats, floor, plan, sent, now, excluded)
        self._pin_arrivals()  # migrated sequences that did not start pull their KV now, seat or no seat
        if proposing is not None and proposing.proposer.on_worker:
            plan.propose = proposing.to_draft(sent.requests, sent.samples)
        if sent.requests:
            self.pack_decodes(plan, sent)
            self.in_flight.record(plan.step_id, sent)
        self.view.finish_plan(plan, self.blocks.take_ops())
        plan.compact_block_base = self.blocks.num_blocks if self.blocks.num_compact_blocks else 0
        if self.tiers is not None:
            plan.tier_moves = self.tiers.take_moves()
        self._hand_off(plan, now)
        return plan

    def _hand_off(self, plan: StepPlan, now: float) -> None:
        """The plan's KV leases and imports (core/kv_handoff.py); leases past their time are released first."""
        leases = self.leases
        if leases.held:
            leases.expire(self.blocks, now)
        plan.kv_revokes, plan.kv_grants, plan.kv_imports = leases.revokes, leases.grants, leases.imports
        leases.revokes, leases.grants, leases.imports = [], [], []
        if self._pulls:  # a plan with imports has work: it is sent
            self._pulls_sent[plan.step_id], self._pulls = self._pulls, []

    def _seats_per_plan(self) -> int:
        """Requests one plan may hold. With disjoint plans, a 1/N share of what can run at once for N plans in
        flight: a plan that took every request would leave the next one empty and the stages in lock-step. Not
        while requests speculate: plans run one at a time then, each with every request (speculator.py)."""
        if not self.mode.disjoint_plans or (self.speculator is not None and self.speculator.lockstep):
            return self.config.max_num_seqs
        runnable = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-runnable // self.mode.plans_in_flight))

    def _maybe_compact(self) -> None:
        interval = self.config.compaction_interval
        if not interval or self._step_id % interval:
            return
        start = time.perf_counter()
        moves = block_relocation.compact(self.blocks, self.config.compaction_max_moves)
        moved = self.view.replace_blocks(self._by_handles(moves))
        self.counters.compaction_moves += moved
        self.counters.compaction_seconds += time.perf_counter() - start

    def interruptible(self, plans: list[StepPlan]) -> bool:
        """May these plans in flight be interrupted at all? The one answer: in a world that can stop mid-step (a
        lone worker: `ExecutionMode.interruptible`), plans whose compute can be skipped (`can_undo`)."""
        return bool(plans) and self.mode.interruptible and self.can_undo(plans)

    def may_interrupt(self, req: Request, plans: list[StepPlan]) -> bool:
        """May `req` have the workers skip these plans in flight? When they are `interruptible` and it outranks
        every request in them by the policy's margin (never under fcfs)."""
        if not self.interruptible(plans):
            return False
        now = self.clock()
        outranks_some = False
        for plan in plans:
            for other in self.in_flight.requests_of(plan.step_id):
                if self._by_handle.get(other.handle) is other:  # still live
                    if not self.policy.displaces(req, other, now):
                        return False
                    outranks_some = True
        return outranks_some

    @staticmethod
    def can_undo(plans: list[StepPlan]) -> bool:
        """Plans whose compute can be skipped: none swaps out (a swapped-out request keeps its computed tokens,
        which a skipped step before it would not have written). A skipped plan still swaps in (its block work
        runs), and a request it preempted recomputes from scratch, so plans that resume a displaced request stay
        interruptible: a realtime request arriving as one resumes does not wait for it."""
        return not any(p.swap_out for p in plans)

    def scheduled_tokens(self, plan: StepPlan) -> int:
        """The tokens a plan in flight computes (`plan.total_tokens`), counted as it was built: no pass over it."""
        return self.in_flight.tokens_of(plan.step_id)

    def requests_in(self, plan: StepPlan) -> list[Request]:
        """The live requests a plan computes."""
        return [r for h in plan.num_scheduled_tokens if (r := self._by_handle.get(h)) is not None]
