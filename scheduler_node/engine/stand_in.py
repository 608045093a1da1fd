"""Stand-in workers: the transport (proto/transport.py) without a model, for measuring and checking the engine.

They keep each request's progress as a worker does (from the plans' diffs) and run every plan the moment it is
sent: each request that reaches the end of its tokens samples one token (`token`), none else. The answer arrives on
the event loop's next turn, as a real transport's does, so the engine yields to the doors' stream readers between
steps. The scheduler, the block table and the engine loop run for real; only the forward pass is free. A plan that
disagrees with what the workers hold (wrong progress, unknown request, a block the world does not have) fails like
a real worker's StepError, so the stand-in also checks that the scheduler's view of the workers stays true.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proto.transport import StepFailed, WorkerLost, WorldCapacity
from proto.wire import Assignment, StepPlan, StepResult


@dataclass(slots=True)
class _Held:
    num_tokens: int
    num_computed: int
    num_blocks: int


class StandInWorkers:
    def __init__(
        self,
        num_kv_blocks: int,
        num_swap_blocks: int = 0,
        token: int = 7,
        tokens_in_plan: bool = False,
        block_size: int = 16,
        acceptance: random.Random | None = None,
        step_seconds: float = 0.0,
    ) -> None:
        self._capacity = WorldCapacity(num_kv_blocks, num_swap_blocks, 1, 1e12)
        self.token = token
        self.tokens_in_plan = tokens_in_plan
        self.block_size = block_size
        # Speculative decoding: how many of a request's proposals are accepted, drawn from this (all when None).
        self.acceptance = acceptance
        # How long a step's answer takes, as a real worker's does. One that comes at once never lets the event loop
        # block, and a thread waiting for the GIL (the output thread) may then not run until the engine is idle:
        # every poll of the loop releases and retakes the GIL before the waiter's switch interval ends.
        self.step_seconds = step_seconds
        self.lost = asyncio.Event()
        self.changed = asyncio.Event()
        self.held: dict[int, _Held] = {}  # by handle
        self.plans = 0
        self.on_plan: Callable[[StepPlan], None] | None = None
        self._pending: set[asyncio.Future[StepResult]] = set()  # answers not delivered yet
        self._replacement: int | None = None  # KV blocks of the worker that replaces a lost rank (`replace_rank`)
        # Faults a test injects. `poison`: that many of the next requests to sample get non-finite logits
        # (StepResult.faulted). `crash`: the next plan that computes something fails with nobody blamed, and so does
        # every later plan that computes its first request (a culprit the worker cannot name). `blamed` hears
        # each request made a culprit (its handle), while it is live.
        self.poison = 0
        self.crash = 0
        self.crashing: set[int] = set()
        self.blamed: Callable[[int], None] = lambda handle: None

    @property
    def all_ready(self) -> bool:
        return not self.lost.is_set()

    @property
    def lost_reason(self) -> str:
        return "the stand-in workers were declared lost" if self.lost.is_set() else ""

    @property
    def num_ready(self) -> int:
        return 0 if self.lost.is_set() else 1

    @property
    def capacity(self) -> WorldCapacity:
        return self._capacity

    async def start(self, assignment: Callable[[int], Assignment], timeout: float) -> WorldCapacity:
        return self._capacity

    def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        if self.lost.is_set():
            raise WorkerLost(self.lost_reason)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[StepResult] = loop.create_future()
        self.plans += 1
        if self.on_plan is not None:
            self.on_plan(plan)
        try:
            outcome: StepResult | Exception = self._crash(plan) or self.execute(plan)
        except ValueError as exc:
            outcome = StepFailed(f"stand-in could not run step {plan.step_id}: {exc}")
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        if self.step_seconds:
            loop.call_later(self.step_seconds, _settle, future, outcome)
        else:
            loop.call_soon(_settle, future, outcome)
        return future

    def replace_rank(self, num_kv_blocks: int) -> None:
        """The rank is lost with its KV (the plans in flight fail with WorkerLost) and a replacement holding
        `num_kv_blocks` joins as soon as the engine waits for one; with fewer blocks, the world shrinks to them."""
        self.lost.set()
        self.held.clear()
        for future in list(self._pending):
            if not future.done():
                future.set_exception(WorkerLost(self.lost_reason))
        self._replacement = num_kv_blocks

    def execute(self, plan: StepPlan, skip: bool = False) -> StepResult:
        """Apply the plan's diffs, then compute it unless `skip` (an interrupted plan: diffs only, as a worker
        does; its progress is not checked, since the plans before it may have been skipped too)."""
        for handle in plan.finished + plan.preempted:
            self.held.pop(handle, None)
        for new in plan.new_requests:
            self._check_blocks(new.block_ids)
            tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.held[new.handle] = _Held(tokens, new.num_computed_tokens, len(new.block_ids))
        drafts: dict[int, int] = {}
        for cached in plan.all_cached_requests:
            if cached.draft_token_ids:
                drafts[cached.handle] = len(cached.draft_token_ids)
            held = self.held.get(cached.handle)
            if held is None:
                raise ValueError(f"request {cached.handle}: not held")
            if not skip and held.num_computed != cached.num_computed_tokens:
                raise ValueError(
                    f"request {cached.handle}: holds {held.num_computed} computed, "
                    f"plan says {cached.num_computed_tokens}"
                )
            self._check_blocks(cached.new_block_ids)
            held.num_blocks += len(cached.new_block_ids)
            held.num_tokens += len(cached.new_token_ids)
        sampled: dict[int, list[int]] = {}
        if skip:
            return StepResult(plan.step_id, sampled, interrupted=True)
        for handle, n in plan.num_scheduled_tokens.items():
            held = self.held[handle]  # every scheduled request came new or cached above
            held.num_computed += n
            proposed = drafts.get(handle, 0)
            if held.num_computed > held.num_tokens + proposed:
                raise ValueError(f"request {handle}: computes {held.num_computed} of {held.num_tokens} tokens")
            if held.num_computed > held.num_blocks * self.block_size:
                raise ValueError(f"request {handle}: {held.num_computed} tokens in {held.num_blocks} blocks")
            if proposed:  # verified: some proposals accepted, the rest's slots rolled back, one token sampled
                if held.num_computed != held.num_tokens + proposed:
                    raise ValueError(f"request {handle}: proposals that do not follow its last token")
                accepted = self.acceptance.randint(0, proposed) if self.acceptance is not None else proposed
                held.num_computed -= proposed - accepted
                sampled[handle] = [self.token] * (accepted + 1)
                if not self.tokens_in_plan:  # else the next plan brings them
                    held.num_tokens += accepted + 1
            elif held.num_computed == held.num_tokens:
                sampled[handle] = [self.token]
                if not self.tokens_in_plan:
                    held.num_tokens += 1
        return StepResult(plan.step_id, sampled, faulted=self._poisoned(sampled) if self.poison else {})

    def _crash(self, plan: StepPlan) -> StepFailed | None:
        """The failure of a plan that computes a crashing request (`crash`), raised after its notices are applied
        (a worker drops the requests a plan says are gone before it computes anything)."""
        if self.crash and plan.num_scheduled_tokens:
            self.crash -= 1
            handle = next(iter(plan.num_scheduled_tokens))
            self.crashing.add(handle)
            self.blamed(handle)
        if self.crashing.isdisjoint(plan.num_scheduled_tokens):
            return None
        for handle in plan.finished + plan.preempted:
            self.held.pop(handle, None)
        return StepFailed(f"stand-in could not run step {plan.step_id}: it crashed")

    def _poisoned(self, sampled: dict[int, list[int]]) -> dict[int, str]:
        """The requests of `sampled` whose logits `poison` makes non-finite."""
        faulted: dict[int, str] = {}
        for handle in sampled:
            if self.poison <= 0:
                break
            self.poison -= 1
            faulted[handle] = "stand-in logits are not finite"
            sampled[handle] = [self.token + 1]  # what the argmax of a NaN row gives: anything
            self.blamed(handle)
        return faulted

    def _check_blocks(self, blocks: Sequence[int]) -> None:
        bad = next((b for b in blocks if not 0 <= b < self._capacity.num_kv_blocks), None)
        if bad is not None:
            raise ValueError(f"block {bad} is outside the world's {self._capacity.num_kv_blocks}")

    def interrupt(self, first_step_id: int, last_step_id: int) -> bool:
        return False  # every plan ran the moment it was sent: there is nothing in flight to skip

    def declare_lost(self, reason: str) -> None:
        self.lost.set()

    async def wait_ready(self, timeout: float | None) -> bool:
        if self.lost.is_set() and self._replacement is not None:
            blocks = min(self._replacement, self._capacity.num_kv_blocks)  # a world never grows back
            self._capacity = dataclasses.replace(self._capacity, num_kv_blocks=blocks)
            self._replacement = None
            self.lost.clear()
            self.changed.set()
        return self.all_ready

    async def close(self, reason: str = "") -> None:
        return None


def _settle(future: asyncio.Future[StepResult], outcome: StepResult | Exception) -> None:
    if future.done():
        return  # the engine dropped the plan (a lost rank, a failed step), or the rank was lost
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
