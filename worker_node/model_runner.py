"""Turns a StepPlan into one forward pass: flat inputs, slot mapping, block tables; then samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from proto.wire import NewRequest, SamplingOptions, StepPlan, StepResult, TokenLogprobs
from worker_node.attention import AttentionMetadata
from worker_node.kv_cache import KVCache
from worker_node.models.llama import LlamaForCausalLM
from worker_node.sampler import sample


@dataclass(slots=True)
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingOptions
    block_ids: list[int]
    num_computed_tokens: int

    @classmethod
    def from_new(cls, r: NewRequest) -> RequestState:
        tokens = r.prompt_token_ids + r.output_token_ids
        return cls(r.req_id, tokens, len(r.prompt_token_ids), r.sampling, r.block_ids, r.num_computed_tokens)


@dataclass(slots=True)
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # token index of each sequence that samples
    samplers: list[RequestState]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.states: dict[str, RequestState] = {}

    def apply_diffs(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in plan.new_requests:
            self.states[new.req_id] = RequestState.from_new(new)
        for cached in plan.cached_requests:
            state = self.states[cached.req_id]
            if state.num_computed_tokens != cached.num_computed_tokens:
                raise RuntimeError(
                    f"{cached.req_id}: worker has {state.num_computed_tokens} computed tokens, "
                    f"plan says {cached.num_computed_tokens}"
                )
            state.block_ids.extend(cached.new_block_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self.apply_diffs(plan)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if plan.num_scheduled_tokens:
            batch = self._prepare(plan)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta)
            logits = self.model.logits(hidden[batch.sample_rows])
            outputs = [len(s.token_ids) - s.num_prompt_tokens for s in batch.samplers]
            tokens, lps = sample(logits, [s.sampling for s in batch.samplers], outputs)
            for state, token, lp in zip(batch.samplers, tokens, lps):
                state.token_ids.append(token)
                sampled[state.req_id] = [token]
                if lp is not None:
                    logprobs[state.req_id] = [lp]
        elapsed = (time.perf_counter() - start) * 1e3
        return StepResult(plan.step_id, sampled, logprobs, elapsed)

    def _prepare(self, plan: StepPlan) -> _Batch:
        work = [(self.states[r], n) for r, n in plan.num_scheduled_tokens.items()]
        work.sort(key=lambda w: w[1] != 1)  # decodes (one query) first, then prefill chunks
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        cu_q = [0]
        sample_rows: list[int] = []
        samplers: list[RequestState] = []
        num_decodes = 0
        for state, n in work:
            start = state.num_computed_tokens
            end = start + n
            ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            tables.append(state.block_ids)
            seq_lens.append(end)
            if n == 1:
                num_decodes += 1
            else:
                cu_q.append(cu_q[-1] + n)
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                sample_rows.append(len(ids) - 1)
                samplers.append(state)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.int64)
        blocks = self._block_table_tensor(tables)
        bs = self.block_size
        owner = torch.repeat_interleave(torch.arange(len(work)), torch.tensor([n for _, n in work]))
        slots = blocks[owner, pos // bs].long() * bs + pos % bs
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            num_decode_tokens=num_decodes,
            decode_block_tables=blocks[:num_decodes].to(dev),
            decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int32, device=dev),
            prefill_block_tables=blocks[num_decodes:].to(dev),
            prefill_cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            prefill_seq_lens=torch.tensor(seq_lens[num_decodes:], dtype=torch.int32, device=dev),
        )
        return _Batch(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            pos.to(dev),
            meta,
            torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            samplers,
        )

    @staticmethod
    def _block_table_tensor(tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
