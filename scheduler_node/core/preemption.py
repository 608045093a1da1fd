"""Preemption: which running request gives way when blocks run out, how (recompute or swap), and starting over
when the workers' KV is gone."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_node.core.config import PreemptionMode, SchedulerConfig
from scheduler_node.core.counters import SchedulerCounters
from scheduler_node.core.kv.block_ops import Written
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.policy import Policy
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import Request, Status
from scheduler_node.core.worker_view import WorkerView

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PreemptionCosts:
    """What elastic preemption weighs: recomputing a victim's tokens vs moving its blocks out and back."""

    ms_per_token: float = 1.0  # refreshed from the workers' step timings
    bytes_per_block: int = 0
    swap_bytes_per_s: float = 0.0  # 0: unknown, swap is never assumed cheaper

    def recompute_ms(self, req: Request) -> float:
        return req.num_computed_tokens * self.ms_per_token

    def swap_ms(self, num_blocks: int) -> float:
        if self.swap_bytes_per_s <= 0:
            return float("inf")
        return 2 * num_blocks * self.bytes_per_block / self.swap_bytes_per_s * 1e3

    def observe(self, execute_ms: float, num_tokens: int) -> None:
        if num_tokens > 0 and execute_ms > 0:
            self.ms_per_token = 0.9 * self.ms_per_token + 0.1 * execute_ms / num_tokens


class Preemption:
    def __init__(
        self,
        config: SchedulerConfig,
        queues: RequestQueues,
        blocks: BlockTable,
        view: WorkerView,
        policy: Policy,
        costs: PreemptionCosts,
        counters: SchedulerCounters,
    ) -> None:
        self.config = config
        self.queues = queues
        self.blocks = blocks
        self.view = view
        self.policy = policy
        self.costs = costs
        self.counters = counters

    def preempt(self, req: Request, mode: PreemptionMode | None = None) -> None:
        """`req` gives its blocks back (freed, or swapped out) and goes back to waiting; the workers forget it."""
        mode = mode or self._mode_for(req)
        tokens = req.num_computed_tokens
        req.num_placeholders = 0  # in-flight tokens of a preempted request are dropped and sampled again
        if mode is PreemptionMode.SWAP:
            blocks = self.blocks.swap_out(req.req_id)
            req.swapped = True
            # positions past the known tokens held in-flight samples; at least the last token is recomputed
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.counters.preemptions_swap += 1
        else:
            blocks = self.blocks.free(req.req_id)
            req.num_computed_tokens = 0
            self.counters.preemptions_recompute += 1
        self.view.forget(req, preempted=True)
        logger.info("preempted %s by %s: %d tokens, %d blocks", req.req_id, mode.value, tokens, blocks)
        self.queues.stop_running(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.queues.enqueue(req)

    def _mode_for(self, req: Request) -> PreemptionMode:
        mode = self.config.preemption_mode
        if mode is PreemptionMode.RECOMPUTE or not self.blocks.can_swap_out(req.req_id):
            return PreemptionMode.RECOMPUTE  # swap space full: fall back
        if mode is PreemptionMode.SWAP:
            return mode
        swap = self.costs.swap_ms(len(self.blocks.blocks_of(req.req_id)))
        return PreemptionMode.SWAP if swap < self.costs.recompute_ms(req) else PreemptionMode.RECOMPUTE

    def pick_victim(self, candidates: list[Request], now: float) -> Request | None:
        """The policy's least valued of these (under a stable order they are in it: the last one)."""
        if self.policy.stable_order:
            return candidates[-1] if candidates else None
        return self.policy.pick_victim(candidates, now)

    def write_or_preempt(
        self, req: Request, first: int, n: int, later: list[Request], held: Callable[[int], bool] | None, now: float
    ) -> tuple[Written | None, bool]:
        """Make positions [first, first + n) of running `req` writable, preempting the least valued of `later` (the
        requests after it in this step's order) that holds blocks it can use while blocks are short. When those are
        all in plans in flight it waits for their results (two big requests preempting each other would take
        turns forever); when there are none it preempts itself. Returns what the write changed (None: no write)
        and whether anyone was preempted."""
        preempted = False
        while (written := self.blocks.write(req.req_id, first, first + n)) is None:
            others = self._same_pool(req, later)
            victim = self.pick_victim([r for r in others if _schedulable(r, held)], now)
            if victim is None and held is not None and any(_running_in_flight(r, held) for r in others):
                break
            victim = victim or req
            self.preempt(victim)
            preempted = True
            if victim is req:
                break
        return written, preempted

    def _same_pool(self, req: Request, others: list[Request]) -> list[Request]:
        """Those of `others` whose blocks are of `req`'s format: preempting (or waiting for) one of the other pool
        frees nothing `req` can use, and a request that did so each step would restart them forever."""
        if not self.blocks.num_compact_blocks:
            return others
        fmt = self.blocks.format_of(req.req_id)
        return [r for r in others if self.blocks.format_of(r.req_id) is fmt]

    def release_blocks(self, req: Request) -> None:
        """A waiting fork lets go of its shared blocks (admission, when nothing runs and no fork can start): it will
        compute its prompt again, from the prefix cache where it can."""
        logger.info("%s releases its shared blocks: nothing runs and no fork can start", req.req_id)
        self.blocks.free(req.req_id)
        req.num_computed_tokens = 0
        self.counters.preemptions_recompute += 1

    def restart_all(self) -> int:
        """The workers' KV is gone or not to be trusted: every running request goes back to waiting, and every
        live request starts over (computed by nobody, swapped and pulling nothing). Returns how many ran."""
        running = self.queues.take_running()
        for req in running:
            req.status = Status.PREEMPTED
            req.num_preemptions += 1
            self.counters.preemptions_recompute += 1
            self.queues.enqueue(req)
        for req in self.queues.requests.values():
            req.num_computed_tokens = 0
            req.num_placeholders = 0
            req.swapped = False
            req.pulling = False  # its import's plan is dropped with the blocks it filled
        return len(running)


def _running_in_flight(req: Request, held: Callable[[int], bool]) -> bool:
    return req.status is Status.RUNNING and held(req.handle)


def _schedulable(req: Request, held: Callable[[int], bool] | None) -> bool:
    return req.status is Status.RUNNING and not (held is not None and held(req.handle))
