"""Preemption: which running request gives way when blocks run out, how (recompute or swap), and starting over
when the workers' KV is gone."""

from __future__ import annotations

import logging
from collections.abc import Callable

from scheduler_node.core import block_relocation
from scheduler_node.core.config import PreemptionMode
from scheduler_node.core.request import Request, Status
from scheduler_node.core.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)


class Preemption(SchedulerState):
    def _preempt(self, req: Request, mode: PreemptionMode | None = None) -> None:
        mode = mode or self._preemption_mode(req)
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
        self.running.remove(req)
        self._catching_up.discard(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self._enqueue(req)

    def _preemption_mode(self, req: Request) -> PreemptionMode:
        mode = self.config.preemption_mode
        if mode is PreemptionMode.RECOMPUTE or not self.blocks.can_swap_out(req.req_id):
            return PreemptionMode.RECOMPUTE  # swap space full: fall back
        if mode is PreemptionMode.SWAP:
            return mode
        swap = self.costs.swap_ms(len(self.blocks.blocks_of(req.req_id)))
        return PreemptionMode.SWAP if swap < self.costs.recompute_ms(req) else PreemptionMode.RECOMPUTE

    def _pick_victim(self, candidates: list[Request], now: float) -> Request | None:
        """The policy's least valued of these (under a stable order they are in it: the last one)."""
        if self.policy.stable_order:
            return candidates[-1] if candidates else None
        return self.policy.pick_victim(candidates, now)

    def _same_pool(self, req: Request, others: list[Request]) -> list[Request]:
        """Those of `others` whose blocks are of `req`'s format: preempting (or waiting for) one of the other pool
        frees nothing `req` can use, and a request that did so each step would restart them forever."""
        if not self.blocks.num_compact_blocks:
            return others
        fmt = self.blocks.format_of(req.req_id)
        return [r for r in others if self.blocks.format_of(r.req_id) is fmt]

    @staticmethod
    def _running_in_flight(req: Request, held: Callable[[int], bool]) -> bool:
        return req.status is Status.RUNNING and held(req.handle)

    @staticmethod
    def _schedulable(req: Request, held: Callable[[int], bool] | None) -> bool:
        return req.status is Status.RUNNING and not (held is not None and held(req.handle))

    def requeue_all(self, workers_lost: bool = True) -> int:
        """The workers' KV is gone (a rank was lost) or not to be trusted (a step failed): every running request
        goes back to waiting, to be recomputed, swapped and forked ones drop their blocks too, and the prefix cache
        starts empty (the replacement worker's cache holds nothing). Workers that were not lost still hold their
        requests: the next plan tells them to forget every one (and the finished ones already noted). Returns how
        many requests were running."""
        running, self.running = self.running, []
        self._catching_up.clear()
        for req in running:
            req.status = Status.PREEMPTED
            req.num_preemptions += 1
            self.counters.preemptions_recompute += 1
            self._enqueue(req)
        for req in self.requests.values():
            req.num_computed_tokens = 0
            req.num_placeholders = 0
            req.swapped = False
            req.pulling = False  # its import's plan is dropped with the blocks it filled
        self._pulls, self._pulls_sent = [], {}
        if workers_lost:
            self.view.forget_all()
        else:
            self.view.preempt_all()
        self._new_table(self.blocks.num_host_blocks, self.blocks.num_compact_blocks)
        self.leases.clear()
        if self.tiers is not None:
            self.tiers.clear()  # until the world is back: then its disk blocks are adopted again (engine core)
        self._attach_tiers()
        self.in_flight.clear()  # the engine dropped every plan in flight
        return len(running)

    def fit_capacity(self, num_blocks: int, num_host_blocks: int, num_compact_blocks: int | None = None) -> None:
        """The world came back holding fewer blocks than before (a replacement could not allocate the world's
        size): only that many are handed out from now on. Called on an empty table, right after `requeue_all`."""
        block_relocation.resize(self.blocks, min(num_blocks, self.blocks.usable_blocks))
        compact = self.blocks.num_compact_blocks if num_compact_blocks is None else num_compact_blocks
        if num_host_blocks < self.blocks.num_host_blocks or compact < self.blocks.num_compact_blocks:
            bt = self.blocks
            self._new_table(min(num_host_blocks, bt.num_host_blocks), min(compact, bt.num_compact_blocks))
            self._attach_tiers()
