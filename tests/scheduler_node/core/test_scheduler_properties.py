"""The scheduler under random arrivals, aborts, preemptions (every mode), interrupts and results for 1..P plans in
flight, against stand-in workers that keep each request's progress from the plans' diffs (as workers do) and fail
any plan that disagrees with what they hold. Invariants hold after every step; at idle every block is free."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from proto.wire import ExecutionMode, SamplingOptions, StepPlan
from scheduler_node.core.config import PreemptionMode, SchedulerConfig
from scheduler_node.core.kv.precision import BlockFormat
from scheduler_node.core.kv.tier_index import KVTiers
from scheduler_node.core.policy import PriorityPolicy
from scheduler_node.core.request import Request, Status, StopConditions
from scheduler_node.core.scheduler import PreemptionCosts, Scheduler
from scheduler_node.engine.stand_in import StandInWorkers
from settings.kv_compact import CompactKV

pytestmark = pytest.mark.unit

BLOCK = 8
SHARED = list(range(100, 100 + 3 * BLOCK))  # a prefix several requests start with (prefix-cache hits)
MODES = {
    "one plan": ExecutionMode.for_world(1, 1, async_scheduling=False),
    "async": ExecutionMode.for_world(1, 1, async_scheduling=True),
    "two stages": ExecutionMode.for_world(1, 2, async_scheduling=True),
    "three stages": ExecutionMode.for_world(1, 3, async_scheduling=True),
}


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        mode=st.sampled_from(sorted(MODES)),
        preemption=st.sampled_from(["recompute", "swap", "elastic"]),
        num_blocks=st.integers(6, 16),
        budget=st.sampled_from([6, 16, 64]),
        seats=st.integers(2, 6),
        tiers=st.sampled_from([(0, 0), (3, 0), (0, 4), (2, 5)]),  # KV offload slots: (RAM, disk)
        compact=st.sampled_from([(0, False), (6, False), (6, True), (12, True)]),  # (compact blocks, under pressure)
    )
    def setup(
        self,
        mode: str,
        preemption: str,
        num_blocks: int,
        budget: int,
        seats: int,
        tiers: tuple[int, int],
        compact: tuple[int, bool] = (0, False),
    ) -> None:
        self.mode = MODES[mode]
        config = SchedulerConfig(
            block_size=BLOCK,
            max_num_batched_tokens=budget,
            max_num_seqs=seats,
            max_model_len=num_blocks * BLOCK,
            preemption_mode=PreemptionMode(preemption),
            watermark=0.0,
        )
        costs = PreemptionCosts(ms_per_token=1.0, bytes_per_block=1, swap_bytes_per_s=1e6)  # elastic: mostly swap
        policy = PriorityPolicy(preemption_margin=5)
        num_compact, under_pressure = compact
        precision = CompactKV(0.5 if num_compact else 0.0, under_pressure=under_pressure, full_priority=90)
        tiers_ = KVTiers(*tiers, policy="arc")
        self.s = Scheduler(
            config, num_blocks, policy, self.mode, 8, costs, tiers=tiers_, num_compact_blocks=num_compact,
            precision=precision,
        )  # fmt: skip
        # The stand-in checks block ids against one range: the full blocks and the compact ones after them.
        total = num_blocks + num_compact
        self.workers = StandInWorkers(total, 8, tokens_in_plan=self.mode.tokens_in_plan, block_size=BLOCK)
        self.in_flight: list[tuple[StepPlan, bool]] = []  # (plan, interrupted), oldest first
        self.groups: dict[str, list[str]] = {}  # a request's sequences (n > 1)
        self.ids = itertools.count()

    # ---- what clients do

    @rule(
        length=st.integers(1, 28),
        shared=st.booleans(),
        max_tokens=st.integers(1, 12),
        n=st.sampled_from([1, 1, 1, 2, 3]),
        priority=st.sampled_from([30, 50, 90]),
        precision=st.sampled_from(["auto", "auto", "full", "compact"]),
    )
    def arrive(
        self, length: int, shared: bool, max_tokens: int, n: int, priority: int, precision: str = "auto"
    ) -> None:
        rid = f"r{next(self.ids)}"
        prompt = (SHARED if shared else []) + [7 + i for i in range(length)]
        if precision == "compact" and self.s.blocks.num_compact_blocks:
            prompt = prompt[: self.s.blocks.num_compact_blocks * BLOCK - max_tokens]
        elif precision == "compact":
            precision = "auto"  # refused at the door without a compact pool
        prompt = prompt[: self.s.config.max_model_len - max_tokens]
        seqs = [
            Request(
                f"{rid}#{i}", prompt, SamplingOptions(0.0), StopConditions(max_tokens), priority, kv_precision=precision
            )
            for i in range(n)
        ]
        self.s.add(seqs[0], forks=seqs[1:])
        self.groups[rid] = [r.req_id for r in seqs]

    @precondition(lambda self: bool(self.groups))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.groups)))
        for req_id in self.groups.pop(rid):
            self.s.finish(req_id, Status.FINISHED_ABORTED)

    # ---- what the engine does

    @precondition(lambda self: len(self.in_flight) < self.mode.plans_in_flight and not self._interrupting())
    @rule()
    def send(self) -> None:
        if not self.s.has_work:
            return
        plan = self.s.schedule()
        if plan.has_work:
            self.in_flight.append((plan, False))

    @precondition(lambda self: bool(self.in_flight))
    @rule()
    def result_arrives(self) -> None:
        plan, interrupted = self.in_flight.pop(0)
        result = self.workers.execute(plan, skip=interrupted)  # raises on a plan that disagrees with the workers
        for out in self.s.update(plan, result):
            if out.request.finished:
                self._forget(out.request.req_id)

    @precondition(lambda self: bool(self.in_flight) and not self._interrupting())
    @rule()
    def interrupt(self) -> None:
        plans = [p for p, _ in self.in_flight]
        if self.s.interruptible(plans):
            self.in_flight = [(p, True) for p in plans]

    def _interrupting(self) -> bool:
        return any(interrupted for _, interrupted in self.in_flight)

    def _forget(self, req_id: str) -> None:
        for rid, seqs in list(self.groups.items()):
            if req_id in seqs and all(r not in self.s.requests for r in seqs):
                del self.groups[rid]

    # ---- invariants

    @invariant()
    def plans_in_flight_hold_disjoint_requests(self) -> None:
        if not self.mode.disjoint_plans:
            return
        seen: set[int] = set()  # request handles
        for plan, _ in self.in_flight:
            assert not seen & set(plan.num_scheduled_tokens), "a request is in two plans in flight"
            seen |= set(plan.num_scheduled_tokens)

    @invariant()
    def progress_never_passes_the_tokens(self) -> None:
        for req in self.s.requests.values():
            assert 0 <= req.num_computed_tokens <= req.num_tokens + req.num_placeholders
            assert len(req.output_token_ids) <= req.stop.max_tokens

    @invariant()
    def each_request_holds_blocks_of_the_format_it_asked(self) -> None:
        bt = self.s.blocks
        for req in self.s.requests.values():
            formats = {bt.block_format(b) for b in bt.blocks_of(req.req_id)}
            assert len(formats) <= 1, f"{req.req_id} holds blocks of two formats"
            wanted = {"full": BlockFormat.FULL, "compact": BlockFormat.COMPACT}.get(req.kv_precision)
            assert wanted is None or formats <= {wanted}, f"{req.req_id} asked {req.kv_precision}, holds {formats}"
            if not (self.s.precision.under_pressure and req.kv_precision == "auto"):
                assert req.kv_precision == "compact" or formats <= {BlockFormat.FULL}, req.req_id
            if req.priority >= self.s.precision.full_priority and req.kv_precision == "auto":
                assert formats <= {BlockFormat.FULL}, f"{req.req_id}: high priority auto got compact blocks"

    @invariant()
    def block_table_is_consistent(self) -> None:
        self.s.blocks.check_invariants()
        if self.s.tiers is not None:
            self.s.tiers.check_invariants()

    def teardown(self) -> None:
        """Run until idle (no new arrivals): everything finishes and every block comes back."""
        if not hasattr(self, "s"):
            return
        for _ in range(100 + 50 * next(self.ids)):  # enough for every request to finish, in any order
            if not self.in_flight and not self.s.has_work:
                break
            before = len(self.in_flight)
            if before < self.mode.plans_in_flight and self.s.has_work and not self._interrupting():
                self.send()
                if len(self.in_flight) > before:
                    continue
            if self.in_flight:
                self.result_arrives()
        assert not self.s.requests and not self.s.waiting and not self.s.running, "requests left at idle"
        assert self.s.blocks.num_free == self.s.blocks.usable_blocks, "blocks held at idle"
        assert self.s.blocks.num_compact_free == self.s.blocks.num_compact_blocks, "compact blocks held at idle"
        assert self.s.blocks.num_host_used == 0, "swap blocks held at idle"
        assert not self.workers.held, "the workers still hold requests at idle"
        self.s.blocks.check_invariants()


TestSchedulerMachine = SchedulerMachine.TestCase
# CI draws the same examples each run (derandomized: a red run is the code's, never the draw's). The randomized
# search, which found the regressions below, runs N fresh examples: MINIVLLM_PROPERTY_EXAMPLES=N (docs/design.md).
_SEARCH = int(os.environ.get("MINIVLLM_PROPERTY_EXAMPLES", "0"))
TestSchedulerMachine.settings = settings(
    max_examples=_SEARCH or 120, stateful_step_count=50, deadline=None, derandomize=not _SEARCH
)


def test_two_sequences_that_each_need_the_whole_cache_do_not_take_turns_forever() -> None:
    """Found by the machine above: three stages (plans in flight hold disjoint requests), recompute, 6 blocks, and
    one request with n = 3 whose sequences each need all 6 blocks. A sequence that needed a block while the other
    ran in a plan in flight preempted itself; the other then did the same; neither ever finished."""
    machine = SchedulerMachine()
    machine.setup(mode="three stages", preemption="recompute", num_blocks=6, budget=6, seats=2, tiers=(0, 0))
    machine.arrive(length=9, max_tokens=9, n=3, priority=30, shared=True)
    machine.teardown()  # runs to idle and asserts that nothing is left


def test_a_request_short_of_full_blocks_does_not_preempt_compact_ones_forever() -> None:
    """Found by the machine above: three stages, recompute, 6 full and 6 compact blocks (auto requests go compact
    when the full pool is tight). A parent and its waiting fork share the whole full pool, and the parent needs a
    free full block to copy their shared last block. It preempted the compact requests out of plans in flight
    (which freed nothing it could use) each time one came back, so they restarted, were preempted again, and
    nobody finished."""
    machine = SchedulerMachine()
    machine.setup(
        mode="three stages", preemption="recompute", num_blocks=6, budget=6, seats=4, tiers=(0, 0), compact=(6, True)
    )
    machine.arrive(length=17, max_tokens=2, n=2, precision="auto", priority=30, shared=True)
    for shared in (False, False, True, True, False):
        machine.arrive(length=1, max_tokens=1, n=1, precision="auto", priority=30, shared=shared)
    machine.teardown()  # runs to idle and asserts that nothing is left
