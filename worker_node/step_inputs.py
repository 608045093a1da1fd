"""A step's inputs, gathered from the rows of the InputBatch (worker_node/batch_rows.py) in a few vectorised
operations: ids, positions, slot mapping, block tables and sequence lengths (the attention metadata), the rows that
sample and their flags, proposals to verify, prompt rows to score or pool. Its Python work is a few operations per
request, not a rebuild of every tensor from lists. The InputBatch (worker_node/input_batch.py) is composed of one
StepGather, handed the batch's rows: it reads them, and advances the computed tokens of the rows a step computes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker_node.batch_rows import BatchRows, RequestState
from worker_node.models.attention import AttentionMetadata
from worker_node.runtime.host_copy import to_device
from worker_node.sampler import RowFlags, SamplingRequest
from worker_node.spec_decode import DraftRows, expand


@dataclass(slots=True)
class StepInputs:
    """One step's inputs, in batch order: full-pool sequences then compact ones; in each, decodes then prefills."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # token index of each sequence that samples
    all_sample: bool  # every token samples, in order: sample_rows is every row of the hidden states
    samplers: list[RequestState]  # the sequences that sample, in the same order
    flags: RowFlags  # theirs
    sampler_rows: np.ndarray  # their rows
    rows: np.ndarray  # the batch's rows
    starts: np.ndarray  # their computed tokens before the step (restored when it is interrupted)
    # prompt_logprobs: (request, first token row, rows, position of the first prompt token they score)
    prompt_rows: list[tuple[RequestState, int, int, int]] = field(default_factory=list)
    # embedding requests: (request, first token row, rows, position of the first) of the prompt rows they pool
    pool_rows: list[tuple[RequestState, int, int, int]] = field(default_factory=list)
    # Speculative decoding: the sampling rows of a step where some samplers have proposals (None: one row each);
    # sample_rows then lists every row to score, and these say whose each is.
    draft_rows: DraftRows | None = None
    # requests with images: (request, first token row, rows, position of the first) of the rows this step computes
    image_rows: list[tuple[RequestState, int, int, int]] = field(default_factory=list)

    @property
    def row_requests(self) -> list[SamplingRequest]:
        """The request of each row the sampler draws at."""
        return self.draft_rows.requests if self.draft_rows is not None else self.samplers  # type: ignore[return-value]

    @property
    def row_flags(self) -> RowFlags:
        return self.draft_rows.flags if self.draft_rows is not None else self.flags


class StepGather:
    """Reads the rows a step computes into its StepInputs."""

    def __init__(self, rows: BatchRows, block_size: int, device: torch.device) -> None:
        self.rows = rows
        self.block_size = block_size
        self.device = device

    def gather(self, rows: np.ndarray, n: np.ndarray, compact_base: int) -> StepInputs:
        """The inputs of a step that computes n[i] tokens of the request in row rows[i], from its computed tokens
        on; advances their computed tokens (InputBatch.restore undoes it). Blocks from `compact_base` on are the
        compact pool's (0: no compact pool)."""
        a = self.rows
        compact = a.block_table[rows, 0] >= compact_base if compact_base else np.zeros(len(rows), dtype=bool)
        drafted = a.num_drafts[rows] > 0
        # Rows with proposals are verified as decodes: each of their tokens a query of its own over its prefix.
        key = compact * 2 + ((n != 1) & ~drafted)
        if key.any():  # full-pool decodes first, then prefills, then the compact pool's
            order = np.argsort(key, kind="stable")
            rows, n, compact, drafted = rows[order], n[order], compact[order], drafted[order]
        start = a.num_computed[rows]
        end = start + n
        held = a.num_tokens[rows] + a.num_drafts[rows]
        self._check(rows, end, held)
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        total = int(cu[-1])
        if total == len(rows):  # decodes only: one token each
            owner, positions = np.arange(len(rows)), start
        else:
            owner = np.repeat(np.arange(len(rows)), n)
            positions = np.arange(total) - cu[:-1][owner] + start[owner]
        ids = a.token_ids[rows[owner], positions].astype(np.int64)
        samples = end == held
        all_sample = total == len(rows) and bool(samples.all())
        sample_rows = cu[1:][samples] - 1
        sampler_rows = rows[samples]
        sample_rows, samplers, flags, draft_rows = self._samplers(sampler_rows, sample_rows)
        prompt_rows = self._prompt_rows(rows, start, end, cu)
        pool_rows = self._pool_rows(rows, start, end, cu)
        image_rows = self._image_rows(rows, start, end, cu)
        a.num_computed[rows] = end
        meta = self._metadata(rows, n, positions, end, compact, (n == 1) | drafted, compact_base)
        dev = self.device
        return StepInputs(
            self._input_ids(ids),
            to_device(positions.astype(np.int64, copy=False), dev),
            meta,
            to_device(sample_rows, dev),
            all_sample,
            samplers,
            flags,
            sampler_rows,
            rows,
            start,
            prompt_rows,
            pool_rows,
            draft_rows,
            image_rows,
        )

    def _samplers(
        self, sampler_rows: np.ndarray, sample_rows: np.ndarray
    ) -> tuple[np.ndarray, list[RequestState], RowFlags, DraftRows | None]:
        """The rows that sample (`sampler_rows`, their last token at `sample_rows`): their requests and flags; with
        proposals to verify, every row to score and whose each is."""
        a = self.rows
        owners = a.owners
        samplers: list[RequestState] = [owners[r] for r in sampler_rows.tolist()]  # type: ignore[misc]
        flags = RowFlags(a.plain[sampler_rows], a.wants_logprobs[sampler_rows])
        draft_rows = None
        if a.num_drafts[sampler_rows].any():
            drafts = [self._drafts_of(s) for s in samplers]
            sample_rows, draft_rows = expand(samplers, flags, drafts, sample_rows)  # type: ignore[arg-type]
        return sample_rows, samplers, flags, draft_rows

    def _metadata(
        self,
        rows: np.ndarray,
        n: np.ndarray,
        positions: np.ndarray,
        end: np.ndarray,
        compact: np.ndarray,
        decode_like: np.ndarray,
        compact_base: int,
    ) -> AttentionMetadata:
        """The attention metadata of the full pool's sequences (first), with the compact pool's beside it."""
        num_full = int(len(rows) - compact.sum())
        full_tokens = len(positions) if num_full == len(rows) else int(n[:num_full].sum())
        meta = self._attention_meta(
            rows[:num_full], n[:num_full], positions[:full_tokens], end[:num_full], 0, decode_like[:num_full]
        )
        if num_full < len(rows):
            meta.compact = self._attention_meta(
                rows[num_full:],
                n[num_full:],
                positions[full_tokens:],
                end[num_full:],
                compact_base,
                decode_like[num_full:],
            )
            meta.num_full_tokens = full_tokens
        return meta

    def _input_ids(self, ids: np.ndarray) -> torch.Tensor:
        """The step's token ids on the device. A token the host does not have yet (a placeholder -(i + 1): the
        last launched step's token i, see InputBatch.reserve) is read where that step left it, on the device."""
        input_ids = to_device(ids, self.device)
        missing = np.flatnonzero(ids < 0)
        if len(missing):
            if self.rows.in_flight is None:
                raise RuntimeError("the step reads a token that no launched step is sampling")
            at = to_device(missing, self.device)
            input_ids[at] = self.rows.in_flight[to_device(-ids[missing] - 1, self.device)]
        return input_ids

    def token_lora_slots(self, inputs: StepInputs) -> np.ndarray | None:
        """Each of a step's tokens' LoRA slot (-1: the base model), in batch order; None when none has one."""
        slots = self.rows.lora_slot[inputs.rows]
        if not slots.any():
            return None
        counts = self.rows.num_computed[inputs.rows] - inputs.starts  # gather advanced them by the step's tokens
        return np.repeat(slots - 1, counts)

    def _drafts_of(self, state: RequestState) -> list[int]:
        n = len(state.token_ids)
        return self.rows.token_ids[state.row, n : n + int(self.rows.num_drafts[state.row])].tolist()

    def _check(self, rows: np.ndarray, end: np.ndarray, held: np.ndarray) -> None:
        bad = np.flatnonzero(end > held)
        if len(bad):
            i = int(bad[0])
            state = self.rows.owners[int(rows[i])]
            assert state is not None
            raise RuntimeError(f"request {state.handle}: the plan computes {end[i]} tokens, the worker holds {held[i]}")
        blocks = self.rows.num_blocks[rows]
        short = np.flatnonzero(-(-end // self.block_size) > blocks)
        if len(short):
            i = int(short[0])
            state = self.rows.owners[int(rows[i])]
            assert state is not None
            raise ValueError(f"request {state.handle}: {end[i]} tokens need more than its {blocks[i]} blocks")

    def _prompt_rows(
        self, rows: np.ndarray, start: np.ndarray, end: np.ndarray, cu: np.ndarray
    ) -> list[tuple[RequestState, int, int, int]]:
        """The prompt rows each request that asked for prompt logprobs scores this step (rows whose next token is
        the prompt's)."""
        wants = self.rows.wants_prompt_logprobs[rows]
        if not wants.any():
            return []
        scored = np.minimum(end, self.rows.num_prompt[rows] - 1) - start
        out = []
        for i in np.flatnonzero(wants & (scored > 0)).tolist():
            state = self.rows.owners[int(rows[i])]
            assert state is not None
            out.append((state, int(cu[i]), int(scored[i]), int(start[i]) + 1))
        return out

    def _pool_rows(
        self, rows: np.ndarray, start: np.ndarray, end: np.ndarray, cu: np.ndarray
    ) -> list[tuple[RequestState, int, int, int]]:
        """The prompt rows each embedding request computes this step ("last" pooling: only the step that
        computes the prompt's last token)."""
        pools = self.rows.pools[rows]
        if not pools.any():
            return []
        out = []
        for i in np.flatnonzero(pools).tolist():
            state = self.rows.owners[int(rows[i])]
            assert state is not None
            count = min(int(end[i]), state.num_prompt_tokens) - int(start[i])
            if count > 0 and (state.sampling.pooling == "mean" or int(end[i]) >= state.num_prompt_tokens):
                out.append((state, int(cu[i]), count, int(start[i])))
        return out

    def _image_rows(
        self, rows: np.ndarray, start: np.ndarray, end: np.ndarray, cu: np.ndarray
    ) -> list[tuple[RequestState, int, int, int]]:
        """The rows of each request with images that this step computes some of whose placeholders."""
        has = self.rows.has_images[rows]
        if not has.any():
            return []
        out = []
        for i in np.flatnonzero(has).tolist():
            state = self.rows.owners[int(rows[i])]
            assert state is not None
            first, last = int(start[i]), int(end[i])
            if any(image.offset < last and image.end > first for image in state.images):
                out.append((state, int(cu[i]), last - first, first))
        return out

    def _attention_meta(
        self,
        rows: np.ndarray,
        n: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        base: int,
        decode_like: np.ndarray,
    ) -> AttentionMetadata:
        """The attention metadata of sequences of one pool, decodes first: their tables (ids from `base` on are
        that pool's own), lengths, and the tokens each computes (`n`, at `positions`). `decode_like` rows (first)
        are decodes, or proposals to verify: each of their tokens attends as a decode at its position (the step
        writes every token's K/V before attending, so token i sees the ones before it and itself)."""
        dev = self.device
        bs = self.block_size
        num_decodes = int(decode_like.sum())
        width = max(1, int(self.rows.num_blocks[rows].max())) if len(rows) else 1
        tables = self.rows.block_table[rows, :width]
        if base:  # the compact pool's own ids; the padding stays zero
            tables = np.where(np.arange(width) < self.rows.num_blocks[rows][:, None], tables - base, 0).astype(np.int32)
        owner = np.repeat(np.arange(len(rows)), n)
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        cu_q = np.zeros(len(rows) - num_decodes + 1, dtype=np.int32)
        np.cumsum(n[num_decodes:], out=cu_q[1:])
        lens = seq_lens.astype(np.int32)
        decode_tables, decode_lens = tables[:num_decodes], lens[:num_decodes]
        decode_tokens = int(n[:num_decodes].sum())
        if decode_tokens != num_decodes:  # proposals: a query per token, with its own row's table
            decode_tables = tables[owner[:decode_tokens]]
            decode_lens = (positions[:decode_tokens] + 1).astype(np.int32)
        return AttentionMetadata(
            slot_mapping=to_device(slots, dev),
            num_decode_tokens=decode_tokens,
            decode_block_tables=to_device(np.ascontiguousarray(decode_tables), dev),
            decode_seq_lens=to_device(decode_lens, dev),
            prefill_block_tables=to_device(np.ascontiguousarray(tables[num_decodes:]), dev),
            prefill_cu_seqlens_q=to_device(cu_q, dev),
            prefill_seq_lens=to_device(lens[num_decodes:], dev),
        )
