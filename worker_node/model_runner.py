"""Runs a StepPlan: its diffs (worker_node/plan_diffs.py) and block operations, one forward pass over the inputs
the InputBatch gathers (worker_node/input_batch.py, worker_node/step_inputs.py), then sampling."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from proto.wire import ExecutionMode, StepPlan, StepResult, TierMove, TokenLogprobs, pack_int32
from worker_node.cuda_graphs import DecodeGraphs
from worker_node.draft_model import DraftModel
from worker_node.input_batch import InputBatch, RequestState
from worker_node.kv_cache import KVCache, copy_blocks
from worker_node.kv_handoff import ImportRun, KVHandoff
from worker_node.kv_offload import DISK, KVOffload, TierRun
from worker_node.lora.manager import LoraManager
from worker_node.models.decoder import CausalLM, StepInterrupted
from worker_node.parallel import SINGLE, Comm
from worker_node.plan_diffs import PlanDiffs
from worker_node.sampler import Drawn, Sampler, token_logprobs
from worker_node.spec_decode import accept
from worker_node.step_inputs import StepInputs
from worker_node.step_overlap import DeviceTokens, Launched

# Prompt rows scored at once for prompt_logprobs: bounds the [rows, vocab] logits a long prefill chunk would need.
PROMPT_LOGITS_ROWS = 256


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


class ModelRunner(PlanDiffs):
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
        self.graphs: DecodeGraphs | None = None  # decode-only steps replay CUDA graphs when set (GPU)
        self.kv_cache = kv_cache
        self.host_cache = host_cache or []
        self.block_size = block_size
        self.device = device
        self.batch = InputBatch(block_size, device)  # the requests this worker holds, one row each
        self.sampler = Sampler(model.config.vocab_size, device, tokenizer_file)
        where = self.comm.where
        self.samples_here = where.is_last_stage and where.tp_rank == 0  # the rank that gets the logits
        self._last_step_end: float | None = None
        # Only a lone worker stops mid-step: ranks of a bigger world could stop at different layers and leave a
        # collective half-joined. The scheduler sends interrupts to lone workers only; this is the second lock.
        self.interrupts = StepInterrupts()
        self.interruptible = self.mode.interruptible and self.comm.where.layout.world_size == 1
        self.num_blocks = kv_cache[0].num_blocks if kv_cache else 0
        # Per-request KV precision: each layer's compact pool (plan block ids from compact_block_base on).
        self.compact_cache: KVCache = [layer.compact for layer in kv_cache if layer.compact is not None]
        self.num_compact_blocks = self.compact_cache[0].num_blocks if self.compact_cache else 0
        self.num_host_blocks = self.host_cache[0].num_blocks if self.host_cache else 0
        self.offload = offload
        # Requests that read a tier block whose load failed: never computed again (their KV is not valid); the
        # scheduler has them recompute and tells this worker to forget them.
        self._load_failed: set[int] = set()
        self.lora: LoraManager | None = None  # made when the first request with a LoRA adapter arrives
        self.handoff: KVHandoff | None = None  # disaggregated prefill/decode: leases served, prefixes pulled
        self.draft: DraftModel | None = None  # speculative decoding's draft model, on the rank that samples
        self.overlap = overlap
        self.overlapped = 0  # steps launched with their tokens left on the device

    def run_block_ops(self, plan: StepPlan) -> TierRun:
        """Swap out, KV tier moves, copy (copy-on-write, compaction), swap in: before the forward pass reads any
        block. Tier moves follow the swap-out (a load may fill a block the swap-out reads) and precede the copies
        and swap-in (an offload reads a block they may overwrite). Returns what the tier moves did."""
        if (plan.swap_out or plan.swap_in) and not self.host_cache:
            raise RuntimeError("the plan swaps but this worker has no swap space")
        copy_blocks(self.kv_cache, self.host_cache, plan.swap_out)
        tiers = self.offload.run(plan.tier_moves, self.kv_cache) if self.offload is not None else TierRun()
        base = plan.compact_block_base
        if base:  # copy-on-write stays within a pool
            copy_blocks(self.kv_cache, self.kv_cache, [(s, d) for s, d in plan.block_copies if s < base])
            compact = [(s - base, d - base) for s, d in plan.block_copies if s >= base]
            copy_blocks(self.compact_cache, self.compact_cache, compact)
        else:
            copy_blocks(self.kv_cache, self.kv_cache, plan.block_copies)
        copy_blocks(self.host_cache, self.kv_cache, plan.swap_in)
        return tiers

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
        if plan.kv_revokes and self.handoff is not None:
            self.handoff.revoke(plan.kv_revokes)  # before any block of theirs can be written again
        rows = self.apply_diffs(plan, check_progress=not skip)
        tiers = self.run_block_ops(plan)
        imports = self._pull_imports(plan)
        failed_loads, failed_stores = self._failed_anywhere(plan, tiers)
        load_skipped = self._leave_out({m.dst for m in failed_loads} | {b for i in imports.failed for b in i.dst})
        counts = np.ones(len(rows), dtype=np.int64)  # the packed decodes (last) compute one token each
        listed = [r.num_scheduled_tokens for r in plan.new_requests] + [
            r.num_scheduled_tokens for r in plan.cached_requests
        ]
        counts[: len(listed)] = listed
        if self._load_failed:
            handles = [r.handle for r in plan.new_requests] + [r.handle for r in plan.cached_requests]
            handles += plan.decodes()[0]
            kept = [h not in self._load_failed for h in handles]
            rows, counts = rows[kept], counts[kept]
        sampled: dict[int, list[int]] = {}
        in_flight: tuple[DeviceTokens, list[tuple[RequestState, int]]] | None = None
        token_handles, packed = b"", b""  # one token each: packed (StepResult.tokens) instead of `sampled`
        logprobs: dict[int, list[TokenLogprobs]] = {}
        prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        pooled: dict[int, tuple[int, int, bytes]] = {}
        drafts: dict[int, list[int]] = {}
        faulted: list[int] = []
        if len(rows) and not skip:
            inputs = self._prepare(rows, counts, plan.compact_block_base)
            if self.samples_here:
                self.sampler.start(inputs.samplers, inputs.flags)  # grammar masks while the forward pass runs
            on_device = self._overlaps(plan, inputs)
            try:
                tokens, lps, prompt_logprobs, pooled, faulted = self._run_and_sample(
                    inputs, lambda: self._interrupted(plan.step_id), on_device
                )
            except StepInterrupted:
                self.sampler.cancel()
                self.batch.restore(inputs)
                skip = True
            else:
                samplers = inputs.samplers
                if isinstance(tokens, DeviceTokens):  # overlapped: the rows hold their tokens' places
                    in_flight = (tokens, self.batch.reserve(inputs, tokens.tokens))
                    token_handles = self.batch.handle[inputs.sampler_rows].astype("<i4").tobytes()
                elif inputs.draft_rows is not None:  # speculative decoding: keep what each sampler's draws accept
                    outputs = accept(tokens, inputs.draft_rows) if tokens else []
                    if self.mode.tokens_in_plan:  # the next plan brings the accepted tokens to every rank
                        self.batch.defer_drafts(inputs)
                    else:
                        self.batch.append_outputs(inputs, outputs)
                    sampled = {state.handle: out for state, out in zip(samplers, outputs)}
                    lps = [lps[i] for i in inputs.draft_rows.firsts.tolist()] if lps else lps
                else:
                    if not self.mode.tokens_in_plan:
                        self.batch.append_sampled(inputs, tokens)
                    if tokens:  # (a rank of an earlier pipeline stage has none)
                        token_handles = self.batch.handle[inputs.sampler_rows].astype("<i4").tobytes()
                        packed = pack_int32(tokens)
                if inputs.flags.logprobs.any():
                    logprobs = {state.handle: [lp] for state, lp in zip(samplers, lps) if lp is not None}
                if plan.propose and self.draft is not None:  # a draft model's proposals for the next step
                    assert not isinstance(tokens, DeviceTokens)  # (a step that proposes does not overlap)
                    states = self.batch.states
                    out = sampled or {s.handle: [token] for s, token in zip(samplers, tokens)}
                    targets = [states[h] for h in plan.propose if h in out and h in states]
                    # With tokens in plans this rank's rows get the tokens just sampled only with the next plan.
                    drafts = self.draft.propose(targets, out if self.mode.tokens_in_plan else None)
        if plan.kv_grants and self.handoff is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the exporter's thread reads what this forward pass wrote
            self.handoff.grant(plan.kv_grants)
        end = time.perf_counter()
        idle = (start - self._last_step_end) * 1e3 if self._last_step_end is not None else 0.0
        self._last_step_end = end
        result = StepResult(
            plan.step_id,
            sampled,
            logprobs,
            (end - start) * 1e3,
            idle,
            interrupted=skip,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
            tier_ms=tiers.ms,
            tier_load_ms=tiers.load_ms,
            failed_loads=[m.block_hash for m in failed_loads] + [h for i in imports.failed for h in i.hashes],
            load_skipped=load_skipped,
            failed_stores=[m.block_hash for m in failed_stores],
            drafts=drafts,
            token_handles=token_handles,
            tokens=packed,
            faulted=dict.fromkeys(faulted, NON_FINITE),
        )
        if in_flight is None:
            return Launched(plan.step_id, lambda: result)
        self.overlapped += 1
        return Launched(plan.step_id, lambda: self._finish(result, start, *in_flight), overlaps=True)

    def _finish(
        self, result: StepResult, start: float, tokens: DeviceTokens, places: list[tuple[RequestState, int]]
    ) -> StepResult:
        """An overlapped step's reply, once its tokens reach the host; they take their places in the batch. Its
        execute_ms runs to then: the launch alone would say nothing of the device's time (preemption weighs it)."""
        values = tokens.values()
        result.faulted = dict.fromkeys(tokens.faulted_handles(), NON_FINITE)
        result.execute_ms = (time.perf_counter() - start) * 1e3
        self.batch.fill(places, values, tokens.tokens)
        result.tokens = pack_int32(values)
        return result

    def _overlaps(self, plan: StepPlan, inputs: StepInputs) -> bool:
        """Whether this step's tokens stay on the device (step_overlap.py): every sampler's token needs nothing
        of the host, and none travels in plans, verifies proposals or feeds a draft model."""
        if not self.overlap or self.mode.tokens_in_plan or plan.propose or inputs.draft_rows is not None:
            return False
        return bool(inputs.samplers) and bool(self.batch.on_device[inputs.sampler_rows].all())

    def _failed_anywhere(self, plan: StepPlan, here: TierRun) -> tuple[list[TierMove], list[TierMove]]:
        """The plan's disk loads and disk writes that failed on any rank: every rank must leave out the same
        requests (the collectives and the stages' hand-offs need equal batches), and a block one rank could not
        write is missing from the world's disk tier. Only plans that move blocks to or from disk ask."""
        moves = [m for m in plan.tier_moves if DISK in (m.src_tier, m.dst_tier)]
        if not moves or self.comm.where.layout.world_size == 1:
            return here.failed, here.failed_stores
        failed_here = here.failed + here.failed_stores
        anywhere = self.comm.any_rank([m in failed_here for m in moves])
        failed = [m for m, bad in zip(moves, anywhere) if bad]
        return [m for m in failed if m.dst_tier != DISK], [m for m in failed if m.dst_tier == DISK]

    def _pull_imports(self, plan: StepPlan) -> ImportRun:
        """The plan's KV imports from other worlds; every rank reports the same failures (an import that failed
        on any rank leaves its requests out on all of them, so the TP/PP batches stay equal)."""
        if not plan.kv_imports or self.handoff is None:
            return ImportRun()
        run = self.handoff.pull(plan.kv_imports)
        if self.comm.where.layout.world_size > 1:
            anywhere = self.comm.any_rank([imp in run.failed for imp in plan.kv_imports])
            run.failed = [imp for imp, bad in zip(plan.kv_imports, anywhere) if bad]
        return run

    def _leave_out(self, bad: set[int]) -> list[int]:
        """The held requests whose blocks include one a failed load (a tier load, a KV import) should have
        filled: left out of this step and of every later one until the scheduler forgets them."""
        if not bad:
            return []
        held = self.batch.states.items()
        out = [h for h, s in held if h not in self._load_failed and not bad.isdisjoint(self.batch.blocks(s))]
        self._load_failed.update(out)
        return out

    def _interrupted(self, step_id: int) -> bool:
        return self.interruptible and self.interrupts.covers(step_id)

    def _run_and_sample(
        self, batch: StepInputs, interrupted: Callable[[], bool] | None = None, on_device: bool = False
    ) -> tuple[
        list[int] | DeviceTokens,
        list[TokenLogprobs | None],
        dict[int, tuple[int, list[TokenLogprobs]]],
        dict[int, Pooled],
        list[int],
    ]:
        """This rank's stage of the forward pass; the output rank samples. With one stage every rank learns
        the tokens now (`on_device`: where they are, as DeviceTokens, their copy to the host under way); with more,
        only the output rank has them (the others get them with the next plan). Last: the handles of the requests
        whose logits were not finite (on the output rank; DeviceTokens knows them when the tokens stay on the
        device), which fail alone."""
        where = self.comm.where
        hidden = None
        if not where.is_first_stage:
            shape = (batch.input_ids.shape[0], self.model.config.hidden_size)
            hidden = self.comm.recv_from_previous_stage(shape, self.dtype)
        lora_slots = self.batch.token_lora_slots(batch) if self.lora is not None else None
        # Graphs read the full pool only; adapter rows replay them when they were captured with LoRA (a slot bank).
        graphs = self.graphs if batch.meta.compact is None else None
        if graphs is not None and lora_slots is not None and graphs.lora is None:
            graphs = None
        if graphs is not None and graphs.fits(batch.meta, batch.input_ids.shape[0]):
            hidden = graphs.run(batch.input_ids, batch.positions, batch.meta, hidden, lora_slots)
        elif lora_slots is not None and self.lora is not None:
            with self.lora.step(lora_slots):
                hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, hidden, interrupted)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, hidden, interrupted)
        if not where.is_last_stage:
            self.comm.send_to_next_stage(hidden)
        tokens: list[int] = []
        lps: list[TokenLogprobs | None] = [None] * len(batch.row_requests)
        prompt: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        drawn: Drawn | None = None
        faulted: list[int] = []
        if where.is_last_stage and batch.samplers:
            rows = hidden if batch.all_sample else hidden[batch.sample_rows]
            logits = self.model.logits(rows)  # a collective over the TP group
            if logits is not None:
                drawn = self.sampler.draw(logits, batch.row_requests, batch.row_flags)
            if drawn is not None and logits is not None and not on_device:
                tokens, faulted = _to_host(drawn)
                lps = self.sampler.logprobs(logits, tokens, batch.row_requests, batch.row_flags)
        if where.is_last_stage and batch.prompt_rows:
            prompt = self._prompt_logprobs(hidden, batch.prompt_rows)
        pooled = pool(hidden, batch.pool_rows) if where.is_last_stage and batch.pool_rows else {}
        handles = [batch.row_requests[i].handle for i in faulted]
        if self.mode.tokens_in_plan:
            return tokens, lps, prompt, pooled, handles
        if on_device:  # (every rank: each embeds them next)
            shared = self.comm.share_sampled_on_device(drawn.tokens if drawn else None, len(batch.row_requests))
            faults = drawn.faulted if drawn is not None else None
            return DeviceTokens(shared, faults, batch.row_requests), lps, prompt, pooled, []
        return self.comm.share_sampled(tokens, len(batch.row_requests)), lps, prompt, pooled, handles

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[tuple[RequestState, int, int, int]]
    ) -> dict[int, tuple[int, list[TokenLogprobs]]]:
        """The logprob of each prompt token after the first, from the logits of the row before it: only for the
        requests that asked (the LM head otherwise runs on sampling rows only), in bounded slices of rows."""
        out: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        for state, first_row, count, first in rows:
            k = state.sampling.prompt_logprobs or 0
            chunk: list[TokenLogprobs] = []
            for offset in range(0, count, PROMPT_LOGITS_ROWS):
                n = min(PROMPT_LOGITS_ROWS, count - offset)
                logits = self.model.logits(hidden[first_row + offset : first_row + offset + n])  # TP collective
                if logits is not None:
                    targets = state.token_ids[first + offset : first + offset + n]
                    chunk += token_logprobs(logits, targets, [k] * n)
            if chunk:
                out[state.handle] = (first, chunk)
        return out

    def _prepare(self, rows: np.ndarray, counts: np.ndarray, compact_base: int) -> StepInputs:
        """The inputs of the requests computed this step (counts[i] tokens of the request in row rows[i]),
        gathered from their rows. Blocks from `compact_base` on are the compact pool's (0: no compact pool)."""
        return self.batch.gather(rows, counts, compact_base)

    def computed_tokens(self, handle: int) -> int:
        """The tokens of a held request whose KV this worker has computed."""
        return self.batch.computed(self.batch.states[handle])


Pooled = tuple[int, int, bytes]
NON_FINITE = "the model's logits for this request are not finite (NaN or infinity), so no token can be sampled"


def _to_host(drawn: Drawn) -> tuple[list[int], list[int]]:
    """The tokens and the faulted rows' indices, read back in one copy."""
    both = torch.stack((drawn.tokens, drawn.faulted.to(drawn.tokens.dtype))).tolist()
    return both[0], [i for i, bad in enumerate(both[1]) if bad]


def pool(hidden: torch.Tensor, rows: list[tuple[RequestState, int, int, int]]) -> dict[int, Pooled]:
    """Each embedding request's final hidden states of this step, pooled in float32: the sum of its prompt rows
    ("mean": the scheduler adds the chunks up and divides), or its prompt's last row ("last")."""
    out: dict[int, Pooled] = {}
    for state, first_row, count, first in rows:
        states = hidden[first_row : first_row + count].float()
        vector = states.sum(0) if state.sampling.pooling == "mean" else states[-1]
        out[state.handle] = (first, count, vector.cpu().numpy().astype("<f4").tobytes())
    return out
