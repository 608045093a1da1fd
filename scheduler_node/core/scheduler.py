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

`Scheduler` is the coordinator: it builds its parts, each handed what it uses, and a step is their passes in
order. The parts, a module each: the live requests and their queues (queues.py), the running pass (running_pass.py),
admission (admission.py) and the blocks a start claims (block_claims.py), preemption (preemption.py), applying a
result (results.py), the cache's capacity (capacity.py), a request's way in and out (lifecycle.py), migrated
sequences pulling their KV (migrations_in.py), taking tokens into a plan (step.py); speculation is the Speculator's
(speculator.py), suspects the Quarantine's (quarantine.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proto.wire import ExecutionMode, StepPlan, StepResult
from scheduler_node.core.admission import Admission
from scheduler_node.core.block_claims import BlockClaims
from scheduler_node.core.capacity import Capacity
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.counters import SchedulerCounters
from scheduler_node.core.in_flight import InFlightLedger
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.leases import KVLeases, Lease
from scheduler_node.core.kv.precision import CompactKV
from scheduler_node.core.kv.prefix_events import KVEventSink
from scheduler_node.core.kv.tier_index import KVTiers
from scheduler_node.core.lifecycle import Lifecycle
from scheduler_node.core.migrations_in import MigrationsIn
from scheduler_node.core.policy import Policy
from scheduler_node.core.preemption import Preemption, PreemptionCosts
from scheduler_node.core.quarantine import Quarantine
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request, Status
from scheduler_node.core.results import RequestOutput, Results
from scheduler_node.core.running_pass import RunningPass
from scheduler_node.core.speculator import Speculator
from scheduler_node.core.step import PlanWriter, Step
from scheduler_node.core.worker_view import WorkerView

__all__ = ["PreemptionCosts", "RequestOutput", "Scheduler", "SchedulerCounters"]


class Scheduler:
    """`schedule` builds a plan under the one rule, `update` applies its result; the rest of the public surface
    (add, finish, capacity, restarts) hands each call to the part that owns it."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        policy: Policy | None = None,
        mode: ExecutionMode | None = None,
        num_host_blocks: int = 0,
        costs: PreemptionCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
        tiers: KVTiers | None = None,
        num_compact_blocks: int = 0,
        precision: CompactKV | None = None,
    ) -> None:
        self._config = config
        self.mode = mode or ExecutionMode()
        self.clock = clock
        self.policy = policy or Policy()
        self.blocks = BlockTable(
            num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks, num_compact_blocks
        )
        self.precision = precision or CompactKV()
        self.tiers = tiers if tiers is not None and tiers.enabled and config.enable_prefix_caching else None
        if self.tiers is not None:
            self.blocks.on_evict = self.tiers.offload  # cached blocks handed out again go to the offload tiers
        self.costs = costs or PreemptionCosts()
        self.counters = SchedulerCounters()
        self.view = WorkerView(self.mode.tokens_in_plan, config.max_loras, config.max_cpu_loras)
        self.in_flight = InFlightLedger(self.mode.disjoint_plans)
        self.quarantine = Quarantine()  # suspects of a step that failed with nobody blamed (core/quarantine.py)
        # Speculative decoding, when configured. With tokens in plans (P > 1 stages) the ranks learn how many
        # proposals were accepted from the request's next plan: speculation runs one plan at a time, so that plan
        # is built after the result (`Speculator.settle`) and carries the rolled-back computed tokens.
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None
        self.leases = KVLeases()  # disaggregated prefill/decode (core/kv/leases.py)
        self._step_id = 0
        self._build_parts()
        self.policy.watch(self.load)  # a StepChoice policy reads it in its schedule()

    def _build_parts(self) -> None:
        """The scheduler's parts, each handed what it uses (and nothing of another part's state)."""
        config, blocks, view, counters = self._config, self.blocks, self.view, self.counters
        self.queues = RequestQueues(self.policy, self.clock)
        self.capacity = Capacity(config, blocks, self.queues, view, counters)
        self.migrations = MigrationsIn(self.queues, blocks, self.leases, counters)
        self.lifecycle = Lifecycle(
            self.queues, blocks, view, self.leases, self.in_flight, self.quarantine, self.speculator, self.migrations,
            self.clock,
        )  # fmt: skip
        self.preemption = Preemption(config, self.queues, blocks, view, self.policy, self.costs, counters)
        self.writer = PlanWriter(view, blocks, self.leases)
        self.claims = BlockClaims(
            config, self.queues, blocks, self.precision, self.tiers, self.leases, self.migrations, counters
        )
        self.admission = Admission(
            config, self.queues, self.policy, self.claims, self.preemption, self.writer, blocks, self.in_flight, view,
            self.migrations,
        )  # fmt: skip
        self.running_pass = RunningPass(
            self.queues, self.policy, blocks, view, self.writer, self.preemption, self.speculator, self.capacity
        )
        self.results = Results(
            self.queues, blocks, self.in_flight, self.preemption, self.migrations, self.capacity, self.speculator,
            self.tiers, self.costs, counters, self.lifecycle.finish,
        )  # fmt: skip

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @config.setter
    def config(self, config: SchedulerConfig) -> None:
        """Another configuration of the same cache (a benchmark narrows max_num_seqs between runs): every part
        that reads one reads this one from now on."""
        self._config = config
        for part in (self.capacity, self.preemption, self.claims, self.admission):
            part.config = config

    # ---- a step

    def schedule(self) -> StepPlan:
        """The step's passes, in order: compaction, displacement for priority, the running requests, admission of
        waiting ones (unless the running pass preempted), migrated arrivals pulling their KV, then the plan's
        diffs, block work and KV hand-offs."""
        self._step_id += 1
        self.policy.begin_step()  # a StepChoice picks this step's order (core/policy.py); others do nothing
        now = self.clock()
        self.capacity.maybe_compact(self._step_id)
        step = self._begin(now)
        preempted = self.running_pass.run(step)
        if not preempted or not self.queues.running:  # a request that preempted itself leaves the cache to others
            self.admission.admit(step)
        self.admission.pin_arrivals()  # migrated sequences that did not start pull their KV now, seat or no seat
        return self._complete(step)

    def _begin(self, now: float) -> Step:
        """What the step decides before its passes: displacement, the prefill floor, speculation's lockstep, the
        seats, who is held by plans in flight and who is left out by the quarantine."""
        budget = self._config.max_num_batched_tokens
        self.admission.displace_for_priority(now, budget)
        floor = self.admission.prefill_floor(now)
        spec = self.speculator
        if spec is not None:
            spec.begin_step(self.queues.running)
            if spec.wait:
                budget = 0  # speculation runs one plan at a time, every request in it (speculator.py)
        seats = self._seats_per_plan()  # after `begin_step`: speculation's lockstep gives one plan every seat
        # Speculating requests are held while their plan is in flight (their next tokens are not known before).
        holds = self.mode.disjoint_plans or (spec is not None and self.in_flight.holds_any)
        held = self.in_flight.held if holds else None
        excluded = self.quarantine.excluded()  # None unless a step failed with nobody blamed
        return Step(StepPlan(self._step_id), now, budget, seats, floor, held, excluded)

    def _complete(self, step: Step) -> StepPlan:
        """The plan, once its requests are in: proposals a draft model makes on the worker, the ledger's entry, the
        workers' diffs and block work, tier moves, KV hand-offs."""
        plan, sent, spec = step.plan, step.sent, self.speculator
        if spec is not None and spec.active and spec.proposer.on_worker:
            plan.propose = spec.to_draft(sent.requests, sent.samples)
        if sent.requests:
            self.writer.pack_decodes(plan, sent)
            self.in_flight.record(plan.step_id, sent)
        self.view.finish_plan(plan, self.blocks.take_ops())
        plan.compact_block_base = self.blocks.num_blocks if self.blocks.num_compact_blocks else 0
        if self.tiers is not None:
            plan.tier_moves = self.tiers.take_moves()
        self._hand_off(plan, step.now)
        return plan

    def _hand_off(self, plan: StepPlan, now: float) -> None:
        """The plan's KV leases and imports (core/kv/leases.py); leases past their time are released first."""
        leases = self.leases
        if leases.held:
            leases.expire(self.blocks, now)
        plan.kv_revokes, plan.kv_grants, plan.kv_imports = leases.revokes, leases.grants, leases.imports
        leases.revokes, leases.grants, leases.imports = [], [], []
        self.migrations.send(plan.step_id)

    def _seats_per_plan(self) -> int:
        """Requests one plan may hold. With disjoint plans, a 1/N share of what can run at once for N plans in
        flight: a plan that took every request would leave the next one empty and the stages in lock-step. Not
        while requests speculate: plans run one at a time then, each with every request (speculator.py)."""
        if not self.mode.disjoint_plans or (self.speculator is not None and self.speculator.lockstep):
            return self._config.max_num_seqs
        runnable = min(self._config.max_num_seqs, self.queues.num_unfinished)
        return max(1, -(-runnable // self.mode.plans_in_flight))

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a plan's result (results.py)."""
        return self.results.update(plan, result)

    # ---- requests in and out (lifecycle.py)

    def add(self, req: Request, forks: list[Request] | None = None) -> None:
        """Queue a request; `forks` (n > 1) start from its prompt's blocks once the prompt is computed."""
        self.lifecycle.add(req, forks)

    def finish(self, req_id: str, status: Status) -> Request | None:
        """End a live request (abort, stop string, error) and free its blocks at once."""
        return self.lifecycle.finish(req_id, status)

    def migrate_out(self, req_id: str, keep_kv: bool) -> tuple[Request | None, Lease | None]:
        """End a live sequence that moves to another replica, its KV held for the target to pull when `keep_kv`."""
        return self.lifecycle.migrate_out(req_id, keep_kv)

    # ---- the live requests

    @property
    def requests(self) -> dict[str, Request]:
        return self.queues.requests

    @property
    def waiting(self) -> list[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def num_unfinished(self) -> int:
        return self.queues.num_unfinished

    def load(self) -> float:
        """The larger of the seats taken (running sequences / max_num_seqs) and the device KV blocks in use, 0..1."""
        seats = len(self.queues.running) / self._config.max_num_seqs
        return min(1.0, max(seats, self.blocks.usage))

    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    @property
    def has_work(self) -> bool:
        pending = self.view.has_notices or self.blocks.ops.pending or self.leases.pending
        return bool(self.queues.num_unfinished or pending)

    def request_of(self, handle: int) -> Request | None:
        """The live request a plan or a result names by this handle."""
        return self.queues.request_of(handle)

    def requests_in(self, plan: StepPlan) -> list[Request]:
        """The live requests a plan computes."""
        live = self.queues.by_handle
        return [r for h in plan.num_scheduled_tokens if (r := live.get(h)) is not None]

    def scheduled_tokens(self, plan: StepPlan) -> int:
        """The tokens a plan in flight computes (`plan.total_tokens`), counted as it was built: no pass over it."""
        return self.in_flight.tokens_of(plan.step_id)

    # ---- interrupting plans in flight

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
                if self.queues.is_live(other):
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

    # ---- the cache: its size, and starting over

    @property
    def max_model_len(self) -> int:
        return self.capacity.max_model_len

    def stranded(self, usable_blocks: int) -> list[Request]:
        return self.capacity.stranded(usable_blocks)

    def resize(self, num_blocks: int) -> int:
        return self.capacity.resize(num_blocks)

    def fit_capacity(self, num_blocks: int, num_host_blocks: int, num_compact_blocks: int | None = None) -> None:
        self.capacity.fit(num_blocks, num_host_blocks, num_compact_blocks)

    def requeue_all(self, workers_lost: bool = True) -> int:
        """The workers' KV is gone (a rank was lost) or not to be trusted (a step failed): every running request
        goes back to waiting, to be recomputed, swapped and forked ones drop their blocks too, and the prefix cache
        starts empty (the replacement worker's cache holds nothing). Workers that were not lost still hold their
        requests: the next plan tells them to forget every one (and the finished ones already noted). Returns how
        many requests were running."""
        num_running = self.preemption.restart_all()
        self.migrations.clear()
        if workers_lost:
            self.view.forget_all()
        else:
            self.view.preempt_all()
        self.blocks.reset(self.blocks.num_host_blocks, self.blocks.num_compact_blocks)
        self.leases.clear()
        if self.tiers is not None:
            self.tiers.clear()  # until the world is back: then its disk blocks are adopted again (engine core)
        self.in_flight.clear()  # the engine dropped every plan in flight
        return num_running

    def expire_leases(self) -> list[str]:
        """Release the KV leases whose time is up (the engine's timer); their request ids."""
        return self.leases.expire(self.blocks, self.clock())

    def release_kv(self, request_id: str) -> bool:
        """Free a producer request's leased blocks (pulled, or its client gave up); False if none are held."""
        return self.leases.release(self.blocks, request_id)

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """From now on every hash that enters or leaves the prefix cache (any tier) is reported to `sink`."""
        self.blocks.events = sink
        if self.tiers is not None:
            self.tiers.events = sink
