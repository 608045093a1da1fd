"""A plan's diffs applied to the requests a worker holds (their rows of the InputBatch: new requests, finished and
preempted ones, new blocks, tokens and proposals, block replacements; the packed steady decodes looked up in one
search), after every block id and count in the plan has been checked: the decode kernel reads the cache through
them without bounds checks, so a bad plan fails here, as a StepError, not as a crash. A new request's LoRA adapter
that cannot be read fails only the requests naming it (a RequestFault), before any new request joins the batch.
The ModelRunner (worker_node/model_runner.py) is composed of one."""

from __future__ import annotations

import numpy as np

from proto.wire import CachedRequest, NewRequest, StepPlan
from worker_node.faults import RequestFault
from worker_node.input_batch import InputBatch
from worker_node.kv.moves import KVMoves, LoadFailures, check_range
from worker_node.lora.checked_read import AdapterUnusable
from worker_node.lora_holder import LoraHolder
from worker_node.sampler import Sampler


class PlanDiffs:
    def __init__(
        self,
        batch: InputBatch,
        sampler: Sampler,  # forgets a request's penalty counts and grammar when it leaves or comes back
        loras: LoraHolder,  # a new request's adapter is placed in a slot
        moves: KVMoves,  # checks the plan's moves
        load_failures: LoadFailures,  # their requests are forgotten with them, and skip the progress check
        num_blocks: int,  # the full pool's blocks
        num_compact_blocks: int,
        has_compact_pool: bool,
        tokens_in_plan: bool,  # the execution mode's: sampled tokens and accepted proposals come in the plans
    ) -> None:
        self.batch = batch
        self.sampler = sampler
        self.loras = loras
        self.moves = moves
        self.load_failures = load_failures
        self.num_blocks = num_blocks
        self.num_compact_blocks = num_compact_blocks
        self.has_compact_pool = has_compact_pool
        self.tokens_in_plan = tokens_in_plan

    def apply(self, plan: StepPlan, check_progress: bool = True) -> np.ndarray:
        """Update the requests this worker holds; their rows, the plan's new requests then its cached ones. Every
        block id is range-checked first: the decode kernel reads the cache through them without bounds checks, so
        a bad plan must fail here (a StepError), not segfault."""
        cached = plan.cached_requests
        changed = [i for i, c in enumerate(cached) if c.new_block_ids or c.new_token_ids or c.draft_token_ids]
        self._check_plan(plan, [cached[i] for i in changed])
        batch = self.batch
        batch.clear_drafts()
        for handle in plan.finished + plan.preempted:
            batch.remove(handle)
            self.load_failures.forget(handle)
            self.sampler.forget(handle)
        self._place_adapters(plan.new_requests)
        rows = []
        for new in plan.new_requests:
            self.sampler.forget(new.handle)  # penalty counts and grammar start over from its tokens
            rows.append(batch.add(new).row)
        states = batch.states
        decode_handles = np.frombuffer(plan.decode_handles, dtype="<i4").astype(np.int64)
        try:
            held = [states[c.handle] for c in cached]
            decode_rows = batch.rows_of(decode_handles)
        except KeyError as exc:
            raise ValueError(f"request {exc.args[0]}: a cached request this worker does not hold") from None
        for i in changed:
            if cached[i].new_block_ids:
                batch.append_blocks(held[i], cached[i].new_block_ids)
            if cached[i].new_token_ids:  # with P > 1 stages: the output rank's samples
                batch.append_tokens(held[i], cached[i].new_token_ids)
            if cached[i].draft_token_ids:  # speculative decoding: proposals to verify this step
                batch.set_drafts(held[i], cached[i].draft_token_ids)
        rows += [s.row for s in held]
        plan_rows = np.concatenate((np.array(rows, dtype=np.int64), decode_rows))
        if cached or len(decode_rows):
            cached_rows = plan_rows[len(plan.new_requests) :]
            said = np.concatenate(
                (
                    np.array([c.num_computed_tokens for c in cached], dtype=np.int64),
                    np.frombuffer(plan.decode_computed, dtype="<i4"),
                )
            )
            if self.tokens_in_plan:  # proposals of the last step: this plan says how many were accepted
                batch.settle_unverified(cached_rows, said)
            if check_progress:
                self._check_progress(cached_rows, said, [c.handle for c in cached] + decode_handles.tolist())
        for handle, changes in plan.block_updates.items():
            if (state := states.get(handle)) is not None:
                for index, block in changes:
                    batch.set_block(state, index, block)
        return plan_rows

    def _place_adapters(self, new_requests: list[NewRequest]) -> None:
        """Each new request's adapter resident in its slot. One that cannot be read fails the plan's requests naming
        it, and only those (RequestFault: the others are recomputed); none of the plan's new requests has joined
        the batch yet, and the plan's finished and preempted requests have left it, as the scheduler counts. A
        fault names one adapter (its reason reaches that adapter's clients only): another unusable one in the same
        plan fails its requests when they are planned again."""
        for new in new_requests:
            if new.lora is None:
                continue
            try:
                self.loras.place(new.lora)
            except AdapterUnusable as exc:
                handles = [r.handle for r in new_requests if r.lora is not None and r.lora.id == exc.lora_id]
                raise RequestFault(handles, exc.reason, [exc.lora_id]) from exc

    def _check_progress(self, rows: np.ndarray, said: np.ndarray, handles: list[int]) -> None:
        """Each cached request's computed tokens are the plan's (`said`, unless a failed tier load left it
        behind)."""
        has = self.batch.rows.num_computed[rows]
        for i in np.flatnonzero(has != said).tolist():
            if handles[i] not in self.load_failures:
                raise RuntimeError(f"request {handles[i]}: worker has {has[i]} computed tokens, plan says {said[i]}")

    def _check_plan(self, plan: StepPlan, changed: list[CachedRequest]) -> None:
        """Every block id the plan names is in range (`changed`: its cached requests with new blocks or tokens)."""
        device_ids = [b for r in plan.new_requests for b in r.block_ids]
        device_ids += [b for r in changed for b in r.new_block_ids]
        device_ids += [b for changes in plan.block_updates.values() for _, b in changes]
        device_ids += [b for pair in plan.block_copies for b in pair]
        base = plan.compact_block_base
        if base and not self.has_compact_pool:
            raise ValueError("the plan addresses compact KV blocks but this worker has no compact pool")
        full_limit = min(base, self.num_blocks) if base else self.num_blocks
        if base:  # ids from the base on are the compact pool's
            compact = [b - base for b in device_ids if b >= base]
            check_range(compact, self.num_compact_blocks, f"compact block id (from {base})")
            device_ids = [b for b in device_ids if b < base]
            crossing = next(((s, d) for s, d in plan.block_copies if (s >= base) != (d >= base)), None)
            if crossing is not None:
                raise ValueError(f"block copy {crossing} crosses KV formats")
        check_range(device_ids, full_limit, "block id")
        self.moves.check(plan, full_limit)
        for r in plan.new_requests:
            check_range([r.num_computed_tokens], len(r.prompt_token_ids) + len(r.output_token_ids) + 1, "computed")
