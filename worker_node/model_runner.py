"""Runs a StepPlan on this rank. A ModelRunner is composed of objects each handed what it uses:

- InputBatch (worker_node/input_batch.py): the requests this worker holds, a row each; gathers a step's inputs;
- PlanDiffs (worker_node/plan_diffs.py): a plan's diffs checked and written into the batch;
- KVMoves and LoadFailures (worker_node/kv/moves.py): the block operations, tier moves and KV hand-offs before the
  forward pass, and the requests a failed load leaves out;
- ForwardPass (worker_node/forward_pass.py): this stage's layers and, on the output rank, sampling;
- Sampler (worker_node/sampler.py), LoraHolder (worker_node/lora_holder.py), and what the loader attaches later:
  the draft model, the KV hand-off, the CUDA graphs.

A step (`launch`): the plan's diffs and KV moves, then the forward pass and sampling over the rows it computes, then
the reply (worker_node/step_reply.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from proto.wire import ExecutionMode, StepPlan, StepResult
from worker_node.cuda_graphs import DecodeGraphs
from worker_node.draft_model import DraftModel
from worker_node.forward_pass import Computed, ForwardPass
from worker_node.input_batch import InputBatch
from worker_node.kv.cache import KVCache
from worker_node.kv.handoff import KVHandoff
from worker_node.kv.moves import KVMoves, LoadFailures, Moved
from worker_node.kv.tiers import KVOffload, TierRun
from worker_node.lora.manager import LoraManager
from worker_node.lora_holder import LoraHolder
from worker_node.models.decoder import CausalLM, StepInterrupted
from worker_node.plan_diffs import PlanDiffs
from worker_node.runtime.parallel import SINGLE, Comm
from worker_node.sampler import Sampler
from worker_node.step_inputs import StepInputs
from worker_node.step_overlap import DeviceTokens, Launched
from worker_node.step_reply import Produced, finish_overlapped, record, reply


@dataclass(slots=True)
class StepInterrupts:
    """Step ids the scheduler interrupted: written by the socket thread, read by the step thread."""

    _ranges: list[tuple[int, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, first_step_id: int, last_step_id: int) -> None:
        with self._lock:
            self._ranges.append((first_step_id, last_step_id))

    def covers(self, step_id: int) -> bool:
        with self._lock:
            self._ranges = [r for r in self._ranges if r[1] >= step_id]  # plans run in order: older ones are done
            return any(first <= step_id for first, _ in self._ranges)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        host_cache: KVCache | None = None,
        comm: Comm | None = None,
        mode: ExecutionMode | None = None,
        tokenizer_file: Path | None = None,  # the model's tokenizer.json: structured output needs it
        offload: KVOffload | None = None,  # KV offload tiers (host RAM, disk): the plans' tier moves
        overlap: bool = False,  # launch the next plan before this step's tokens reach the host (step_overlap.py)
    ) -> None:
        self.model = model
        self.comm = comm or Comm(SINGLE)  # every rank runs every plan; only the output rank samples
        # With tokens in the plan (P > 1 stages) the sampled tokens reach the other ranks in the next plan (the
        # scheduler schedules a request again only once it has its token), so no stage waits for the last one.
        self.mode = mode or ExecutionMode()
        self.dtype = next(model.parameters()).dtype
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.num_blocks = kv_cache[0].num_blocks if kv_cache else 0
        # Per-request KV precision: each layer's compact pool (plan block ids from compact_block_base on).
        compact_cache: KVCache = [layer.compact for layer in kv_cache if layer.compact is not None]
        self.num_compact_blocks = compact_cache[0].num_blocks if compact_cache else 0
        where = self.comm.where
        self.samples_here = where.is_last_stage and where.tp_rank == 0  # the rank that gets the logits
        self.batch = InputBatch(block_size, device)  # the requests this worker holds, one row each
        self.sampler = Sampler(model.config.vocab_size, device, tokenizer_file)
        self.loras = LoraHolder(model, self.dtype, device)
        self.load_failures = LoadFailures()
        self.moves = KVMoves(kv_cache, host_cache or [], compact_cache, self.comm, device, offload)
        self.diffs = PlanDiffs(
            self.batch,
            self.sampler,
            self.loras,
            self.moves,
            self.load_failures,
            self.num_blocks,
            self.num_compact_blocks,
            bool(compact_cache),
            self.mode.tokens_in_plan,
        )
        self.forward = ForwardPass(model, kv_cache, self.comm, self.mode, self.sampler, self.batch.inputs, self.loras)
        # Only a lone worker stops mid-step: ranks of a bigger world could stop at different layers and leave a
        # collective half-joined. The scheduler sends interrupts to lone workers only; this is the second lock.
        self.interrupts = StepInterrupts()
        self.interruptible = self.mode.interruptible and where.layout.world_size == 1
        self.draft: DraftModel | None = None  # speculative decoding's draft model, on the rank that samples
        self.overlap = overlap
        self.overlapped = 0  # steps launched with their tokens left on the device
        self._last_step_end: float | None = None

    # ---- what the loader attaches after the runner is built (each lives with the object that uses it)

    @property
    def lora(self) -> LoraManager | None:
        """The LoRA manager (None until a request brings an adapter, unless the loader attached a slot bank)."""
        return self.loras.manager

    @lora.setter
    def lora(self, manager: LoraManager | None) -> None:
        self.loras.manager = manager

    def lora_manager(self) -> LoraManager:
        """The LoRA manager, made now if no request has brought an adapter yet."""
        return self.loras.made()

    @property
    def handoff(self) -> KVHandoff | None:
        """Disaggregated prefill/decode: leases served, prefixes pulled (None: not set up)."""
        return self.moves.handoff

    @handoff.setter
    def handoff(self, handoff: KVHandoff | None) -> None:
        self.moves.handoff = handoff

    @property
    def graphs(self) -> DecodeGraphs | None:
        """Decode-only steps replay these CUDA graphs when set (GPU)."""
        return self.forward.graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self.forward.graphs = graphs

    # ---- a step

    def apply_diffs(self, plan: StepPlan, check_progress: bool = True) -> np.ndarray:
        """The plan's diffs (checked first) in the batch; the rows of its requests, in the plan's order."""
        return self.diffs.apply(plan, check_progress)

    def run_block_ops(self, plan: StepPlan) -> TierRun:
        """The plan's block operations (swaps, tier moves, copies); what the tier moves did."""
        return self.moves.run_block_ops(plan)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan to its reply."""
        return self.launch(plan).finish()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Run the plan up to its reply. With `overlap`, a step whose tokens need nothing of the host leaves
        them on the device: its `finish` reads them, and the next plan may be launched first (step_overlap.py)."""
        start = time.perf_counter()
        # An interrupted plan was built on steps before it that may not have run: their progress is not checked.
        skip = self._interrupted(plan.step_id)
        rows, counts, moved, load_skipped = self._prepare(plan, check_progress=not skip)
        produced = None
        if len(rows) and not skip:
            produced = self._compute(plan, rows, counts)
            skip = produced is None
        self.moves.grant(plan)
        end = time.perf_counter()
        idle = (start - self._last_step_end) * 1e3 if self._last_step_end is not None else 0.0
        self._last_step_end = end
        produced = produced or Produced()
        result = reply(plan, produced, moved, load_skipped, (end - start) * 1e3, idle, skip)
        if produced.in_flight is None:
            return Launched(plan.step_id, lambda: result)
        self.overlapped += 1
        tokens, places = produced.in_flight
        return Launched(
            plan.step_id, lambda: finish_overlapped(result, start, self.batch, tokens, places), overlaps=True
        )

    def _prepare(self, plan: StepPlan, check_progress: bool) -> tuple[np.ndarray, np.ndarray, Moved, list[int]]:
        """The plan's diffs and KV moves, before any compute: the rows it computes and how many tokens each (the
        requests a failed load left out, now or before, dropped), what the moves did, and whom they left out now."""
        self.moves.revoke(plan)  # before any block of theirs can be written again
        if self.draft is not None and (plan.finished or plan.preempted):
            self.draft.forget(plan.finished + plan.preempted)
        rows = self.diffs.apply(plan, check_progress)
        moved = self.moves.run(plan)
        load_skipped = self.load_failures.leave_out(moved.bad_blocks, self.batch)
        counts = np.ones(len(rows), dtype=np.int64)  # the packed decodes (last) compute one token each
        listed = [r.num_scheduled_tokens for r in plan.new_requests] + [
            r.num_scheduled_tokens for r in plan.cached_requests
        ]
        counts[: len(listed)] = listed
        rows, counts = self.load_failures.kept(plan, rows, counts)
        return rows, counts, moved, load_skipped

    def _compute(self, plan: StepPlan, rows: np.ndarray, counts: np.ndarray) -> Produced | None:
        """The forward pass and sampling over the rows (counts[i] tokens of the request in rows[i]), their tokens
        recorded in the batch, and a draft model's proposals; None when the step was interrupted mid-way (its
        rows are as they were)."""
        inputs = self.batch.gather(rows, counts, plan.compact_block_base)
        if self.samples_here:
            self.sampler.start(inputs.samplers, inputs.flags)  # grammar masks while the forward pass runs
        on_device = self._overlaps(plan, inputs)
        try:
            computed = self.forward.run(inputs, lambda: self._interrupted(plan.step_id), on_device)
        except StepInterrupted:
            self.sampler.cancel()
            self.batch.restore(inputs)
            return None
        produced = record(self.batch, inputs, computed, self.mode.tokens_in_plan)
        if plan.propose and self.draft is not None:
            produced.drafts = self._propose(plan, inputs, computed, produced.sampled)
        return produced

    def _propose(
        self, plan: StepPlan, inputs: StepInputs, computed: Computed, sampled: dict[int, list[int]]
    ) -> dict[int, list[int]]:
        """A draft model's proposals for the next step, for the requests the plan asks of it."""
        assert self.draft is not None and not isinstance(computed.tokens, DeviceTokens)  # (a proposing step waits)
        states = self.batch.states
        out = sampled or {s.handle: [token] for s, token in zip(inputs.samplers, computed.tokens)}
        targets = [states[h] for h in plan.propose if h in out and h in states]
        # With tokens in plans this rank's rows get the tokens just sampled only with the next plan.
        return self.draft.propose(targets, out if self.mode.tokens_in_plan else None)

    def _overlaps(self, plan: StepPlan, inputs: StepInputs) -> bool:
        """Whether this step's tokens stay on the device (step_overlap.py): every sampler's token needs nothing
        of the host, and none travels in plans, verifies proposals or feeds a draft model."""
        if not self.overlap or self.mode.tokens_in_plan or plan.propose or inputs.draft_rows is not None:
            return False
        return bool(inputs.samplers) and self.batch.on_device(inputs.sampler_rows)

    def _interrupted(self, step_id: int) -> bool:
        return self.interruptible and self.interrupts.covers(step_id)

    def computed_tokens(self, handle: int) -> int:
        """The tokens of a held request whose KV this worker has computed."""
        return self.batch.computed(self.batch.states[handle])
