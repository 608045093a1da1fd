"""Results: what a step's result does to the scheduler's view (sampled tokens, stop conditions, prefix-cache
hashes of the blocks it filled, forks started, proposals settled, a draft model's next proposals, tier loads and
KV imports that failed) and what an interrupted step undoes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgspec

from proto.wire import StepPlan, StepResult, TokenLogprobs, unpack_int32
from scheduler_node.core.capacity import Capacity
from scheduler_node.core.config import PreemptionMode
from scheduler_node.core.counters import SchedulerCounters
from scheduler_node.core.in_flight import InFlightLedger, SentPlan
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.kv.tier_index import KVTiers
from scheduler_node.core.migrations_in import MigrationsIn
from scheduler_node.core.preemption import Preemption, PreemptionCosts
from scheduler_node.core.queues import RequestQueues
from scheduler_node.core.request import FinishReason, Request, Status
from scheduler_node.core.speculator import Speculator

logger = logging.getLogger(__name__)


class RequestOutput(msgspec.Struct, gc=False):
    """What one step produced for one request. The output side reads it on its own thread while the engine goes
    on changing the request: what ends it is copied here when it ends, and the rest of the request is only read
    for what no later step changes (its id, its prompt, its complete prompt logprobs). A Struct, never encoded:
    made for every request at every step, it is built in C (a third of a dataclass's cost), untracked by the
    collector (nothing refers back to it: it is in no cycle)."""

    request: Request
    new_token_ids: list[int]  # the step's tokens (several with speculative decoding), up to the one that ended it
    logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)
    finish_reason: FinishReason | None = None  # set when these tokens ended it
    stopped_by_token: bool = False  # ended by eos or a stop token: the last token is not part of the text
    num_output_tokens: int = 0  # with finish_reason: all its output tokens
    cached_tokens: int = 0  # with finish_reason: of its prompt, found in the prefix cache
    embedding: list[float] | None = None  # with finish_reason, an embedding request's


class Results:
    def __init__(
        self,
        queues: RequestQueues,
        blocks: BlockTable,
        in_flight: InFlightLedger,
        preemption: Preemption,
        migrations: MigrationsIn,
        capacity: Capacity,
        speculator: Speculator | None,
        tiers: KVTiers | None,
        costs: PreemptionCosts,
        counters: SchedulerCounters,
        finish: Callable[[str, Status], Request | None],
    ) -> None:
        self.queues = queues
        self.blocks = blocks
        self.in_flight = in_flight
        self.preemption = preemption
        self.migrations = migrations
        self.capacity = capacity
        self.speculator = speculator
        self.tiers = tiers
        self.costs = costs
        self.counters = counters
        self.finish = finish  # the scheduler's: a request its tokens ended leaves as any other

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Register the blocks the step filled for prefix caching, append sampled tokens, apply stop conditions."""
        sent = self.in_flight.settle(plan.step_id)
        if result.failed_loads:
            self._recompute_failed_loads(result)
        self.migrations.settle(plan.step_id, result.failed_loads)
        if result.failed_stores and self.tiers is not None:
            self.tiers.drop_failed_stores(result.failed_stores)
        if result.interrupted:
            self._undo(sent)
            return []
        tokens = sent.total_tokens
        self.costs.observe(result.execute_ms, tokens)
        if self.tiers is not None:
            self.tiers.observe(result)
        if sent.requests:
            self.counters.steps += 1
            self.counters.worker_idle_ms += result.idle_ms
            self.counters.scheduled_tokens += tokens
        if sent.num_drafted:
            assert self.speculator is not None, "only a speculator's plans carry proposals"
            self.speculator.settle(sent, result)
        self._register_filled_blocks(sent)
        self._add_prompt_outputs(result)
        all_logprobs = result.logprobs
        if result.tokens and not all_logprobs:
            outputs = self._apply_packed(result)
        else:
            outputs = self._apply_sampled(result.sampled_items(), all_logprobs)
        if self.speculator is not None:
            if sent.num_drafted:
                self._register_filled_blocks(sent)  # the blocks filled by accepted proposals: hashable only now
            live, running = self.queues.by_handle, Status.RUNNING
            for handle, drafted in result.drafts.items():  # a draft model's proposals for the next step
                if (req := live.get(handle)) is not None and req.status is running:
                    self.speculator.drafted(req, drafted)
        return outputs

    def _add_prompt_outputs(self, result: StepResult) -> None:
        """Prompt logprobs and pooled hidden states of the prompt chunks the step computed."""
        live = self.queues.by_handle
        for handle, (first, logprobs) in result.prompt_logprobs.items():
            if (req := live.get(handle)) is not None:  # kept even if preempted since: positions checked
                req.add_prompt_logprobs(first, logprobs)
        for handle, (first, count, data) in result.pooled.items():
            if (req := live.get(handle)) is not None:
                req.add_pooled(first, count, data)

    def _apply_packed(self, result: StepResult) -> list[RequestOutput]:
        """A result of one token per request and no logprobs (StepResult.tokens): the common step of a batch of
        decodes, each request's token appended with a few operations (`_apply_sampled` for one that may end)."""
        outputs: list[RequestOutput] = []
        max_len, running, output = self.capacity.max_model_len, Status.RUNNING, outputs.append
        live = map(self.queues.by_handle.get, unpack_int32(result.token_handles))  # looked up in C
        ends: list[tuple[int, list[int]]] = []
        for req, token in zip(live, unpack_int32(result.tokens)):
            if req is None or req.status is not running:
                continue  # aborted or preempted while the step ran
            out, stop = req.output_token_ids, req.stop
            n = len(out) + 1
            if n < stop.max_tokens and n < max_len - len(req.prompt_token_ids) and token not in stop.ending:
                req.num_placeholders -= 1
                out.append(token)
                if req.forks:
                    self._start_forks(req)
                output(RequestOutput(req, [token]))
            else:
                ends.append((req.handle, [token]))  # it may end: the general way, in this result's order after these
        if ends:
            outputs += self._apply_sampled(ends, {})
        return outputs

    def _apply_sampled(
        self, items: Iterable[tuple[int, list[int]]], all_logprobs: dict[int, list[TokenLogprobs]]
    ) -> list[RequestOutput]:
        """Each sampling request's tokens (several with proposals) appended up to the one that ends it, with their
        logprobs; the requests they ended finish."""
        outputs: list[RequestOutput] = []
        # Once per sampling request per step: what the loop calls is looked up once, here.
        max_len, running = self.capacity.max_model_len, Status.RUNNING
        live, output = self.queues.by_handle, outputs.append
        for handle, token_ids in items:
            req = live.get(handle)
            if req is None or req.status is not running:
                continue  # aborted or preempted while the step ran
            req.num_placeholders -= 1  # one sampling step: one token, or with proposals the accepted ones and one
            # `Request.append_tokens`' common case, inline (every request at every step): none of them may end it.
            out, stop = req.output_token_ids, req.stop
            n = len(out) + len(token_ids)
            if n < stop.max_tokens and n < max_len - len(req.prompt_token_ids) and stop.ending.isdisjoint(token_ids):
                out += token_ids
                kept = token_ids
            else:
                kept = req.append_tokens(token_ids, max_len)
            if req.forks:
                self._start_forks(req)
            if req.status is running and not all_logprobs:
                output(RequestOutput(req, kept))  # the common case
                continue
            logprobs = all_logprobs[handle][: len(kept)] if all_logprobs and handle in all_logprobs else []
            if req.status is running:
                output(RequestOutput(req, kept, logprobs))
                continue
            end = req.status  # it finished
            outputs.append(RequestOutput(req, kept, logprobs, *_ending(req)))
            self.finish(req.req_id, end)
        return outputs

    def _recompute_failed_loads(self, result: StepResult) -> None:
        """Tier blocks the workers could not load (a disk copy corrupted since start): no tier or prefix match
        offers them again, and every request that reads them (those the workers left out of the step, and any
        later one that found them in the device cache) computes them instead: preempted by recompute, it comes
        back with its cached prefix and recomputes from the first failed block on."""
        logger.warning("%d KV block(s) failed to load or import: recomputing them", len(result.failed_loads))
        if self.tiers is not None:
            self.tiers.forget_failed(result.failed_loads)
        bad = {b for h in result.failed_loads if (b := self.blocks.uncache(h)) is not None}
        readers = [r for h in result.load_skipped if (r := self.queues.request_of(h)) is not None]
        readers += [r for r in self.queues.running if not bad.isdisjoint(self.blocks.blocks_of(r.req_id))]
        for req in dict.fromkeys(readers):
            if req.migration_imports:  # a migrated sequence whose pull failed: it recomputes after all
                self.migrations.pull_failed(req)
            if req.status is Status.RUNNING:
                self.preemption.preempt(req, PreemptionMode.RECOMPUTE)
            elif req.swapped:  # swapped out since, with the bad block: its copy is dropped too
                self.blocks.free(req.req_id)
                req.swapped = False
                req.num_computed_tokens = 0

    def _register_filled_blocks(self, sent: SentPlan) -> None:
        """The blocks each request's step filled (one in block_size decode steps) get their hashes. This step's
        own end counts, not num_computed_tokens: that counts plans still in flight, whose blocks are not written
        yet (and are never written if those plans are interrupted)."""
        bt = self.blocks
        if not bt.enable_prefix_caching:
            return
        bs = bt.block_size
        # Those whose step filled a block, picked in one pass: most steps of a decode fill none. With one token
        # each (a plan of decodes, told by a pass in C), a step fills a block where it ends on one: a cheaper test.
        tokens, ends = sent.tokens, sent.ends
        if tokens.count(1) == len(tokens):
            filled = [i for i, end in enumerate(ends) if not end % bs]
        else:
            filled = [i for i, (n, end) in enumerate(zip(tokens, ends)) if end // bs > (end - n) // bs]
        for i in filled:
            req, n, end, run = sent.requests[i], sent.tokens[i], sent.ends[i], sent.runs[i]
            first_block, full = (end - n) // bs, end // bs
            if req.status is Status.RUNNING and req.num_preemptions == run:
                hashes = req.update_block_hashes(bs)  # accepted proposals are hashable once they are tokens
                bt.register(req.req_id, hashes, first_block, min(full, len(hashes)))

    def _undo(self, sent: SentPlan) -> None:
        """The workers skipped this plan's compute: its requests are back where they were before it (the
        blocks it allocated stay theirs; its diffs and block operations did run)."""
        self.counters.interrupted_steps += 1
        for req, n, samples, run in zip(sent.requests, sent.tokens, sent.samples, sent.runs):
            if req.status is not Status.RUNNING or req.num_preemptions != run:
                continue  # finished or preempted since: nothing of this step is kept for it
            req.num_computed_tokens -= n
            if samples:
                req.num_placeholders -= 1
            self.queues.catching_up(req)

    def _start_forks(self, parent: Request) -> None:
        """The prompt is computed: each sibling shares its blocks and recomputes only the last prompt token,
        so it samples its own first token; the shared last block is copied when first written."""
        prompt_len = len(parent.prompt_token_ids)
        for child in parent.forks:
            self.blocks.fork(parent.req_id, child.req_id, prompt_len)
            child.num_computed_tokens = prompt_len - 1
            child.num_cached_tokens = parent.num_cached_tokens  # the prompt they share
            self.queues.enqueue(child)
        parent.forks = ()


def _ending(req: Request) -> tuple[FinishReason, bool, int, int, list[float] | None]:
    """What a RequestOutput copies of a request its tokens ended (the output side reads it on another thread)."""
    embedding = req.embedding() if req.sampling.pooling else None
    return req.status.finish_reason, req.stopped_by_token, len(req.output_token_ids), req.num_cached_tokens, embedding
