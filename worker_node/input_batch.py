"""The requests a worker holds, as rows of preallocated arrays; a step's inputs gathered from them in a few
vectorised operations.

Each request owns a row from the plan that brings it (new, or back after preemption) until a plan finishes or
preempts it: its token ids, how many it holds and how many are computed, its block table, and whether it wants
its prompt's logprobs. A plan's diffs write rows (blocks and tokens appended, blocks replaced); a step reads the
rows of its requests with numpy (ids, positions, slot mapping, block tables, sequence lengths, the rows that
sample), so its cost does not grow with the tokens or blocks requests hold, and its Python work is a few
operations per request, not a rebuild of every tensor from lists. The arrays double when a request outgrows them
and keep their peak size. The token ids are also kept as a list per request (RequestState.token_ids): the sampler's
processors, the grammar matchers and prompt logprobs read them there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from proto.wire import NewRequest, SamplingOptions
from worker_node.attention import AttentionMetadata
from worker_node.sampler import RowFlags, SamplingRequest, is_plain
from worker_node.spec_decode import DraftRows, expand


@dataclass(slots=True)
class RequestState:
    """What the worker keeps of a request besides its row's arrays (what the sampler reads, see SamplingRequest)."""

    handle: int  # the request's id on the wire
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling: SamplingOptions
    row: int  # its row in the InputBatch
    resumed: bool = False  # came back with output tokens: its prompt logprobs were delivered already


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

    @property
    def row_requests(self) -> list[SamplingRequest]:
        """The request of each row the sampler draws at."""
        return self.draft_rows.requests if self.draft_rows is not None else self.samplers  # type: ignore[return-value]

    @property
    def row_flags(self) -> RowFlags:
        return self.draft_rows.flags if self.draft_rows is not None else self.flags


_ROW_ARRAYS = (
    "token_ids", "num_tokens", "num_computed", "num_prompt", "block_table", "num_blocks", "wants_prompt_logprobs",
    "plain", "wants_logprobs", "pools", "num_drafts", "num_unverified", "lora_slot", "handle", "held",
)  # fmt: skip


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, rows: int = 64) -> None:
        self.block_size = block_size
        self.device = device
        self.states: dict[int, RequestState] = {}  # by handle
        self.owners: list[RequestState | None] = [None] * rows  # by row
        self._free = list(range(rows - 1, -1, -1))
        self.token_ids = np.zeros((rows, 256), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.num_prompt = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, 16), dtype=np.int32)  # past num_blocks: zeros (the tables' padding)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.wants_prompt_logprobs = np.zeros(rows, dtype=bool)
        self.plain = np.zeros(rows, dtype=bool)  # the sampler's RowFlags
        self.wants_logprobs = np.zeros(rows, dtype=bool)
        self.pools = np.zeros(rows, dtype=bool)  # an embedding request
        self.lora_slot = np.zeros(rows, dtype=np.int64)  # its LoRA adapter's slot + 1 (0: the base model)
        self.num_drafts = np.zeros(rows, dtype=np.int64)  # proposals held past num_tokens for this step only
        # Tokens in plans (P > 1 stages): proposals computed in the last step that included the row, counted as
        # computed until the next plan that includes it says how many were accepted (`settle_unverified`).
        self.num_unverified = np.zeros(rows, dtype=np.int64)
        self.handle = np.zeros(rows, dtype=np.int64)  # the request's handle
        self.held = np.zeros(rows, dtype=bool)  # the row is a request's
        # The held handles sorted, and their rows: `rows_of` looks a plan's packed decodes up in them with one
        # search. Rebuilt (vectorised) on the first lookup after a request came or went; None until then.
        self._index: tuple[np.ndarray, np.ndarray] | None = None

    # ---- rows: written by a plan's diffs

    def add(self, r: NewRequest) -> RequestState:
        """A request the plan brings in full (new, or back after preemption): a row of its own."""
        self.remove(r.handle)  # a handle sent again in full starts over
        tokens = r.prompt_token_ids + r.output_token_ids
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._fit(len(tokens), len(r.block_ids))
        state = RequestState(r.handle, tokens, len(r.prompt_token_ids), r.sampling, row, bool(r.output_token_ids))
        self.states[r.handle] = self.owners[row] = state
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed[row] = r.num_computed_tokens
        self.num_prompt[row] = len(r.prompt_token_ids)
        self.block_table[row] = 0
        self.block_table[row, : len(r.block_ids)] = r.block_ids
        self.num_blocks[row] = len(r.block_ids)
        self.wants_prompt_logprobs[row] = r.sampling.prompt_logprobs is not None and not state.resumed
        self.plain[row] = is_plain(r.sampling)
        self.wants_logprobs[row] = r.sampling.logprobs is not None
        self.pools[row] = bool(r.sampling.pooling)
        self.lora_slot[row] = 0 if r.lora is None else r.lora.slot + 1
        self.num_drafts[row] = 0
        self.num_unverified[row] = 0
        self.handle[row] = r.handle
        self.held[row] = True
        self._index = None
        return state

    def remove(self, handle: int) -> None:
        state = self.states.pop(handle, None)
        if state is not None:
            self.owners[state.row] = None
            self.held[state.row] = False
            self._free.append(state.row)
            self._index = None

    def rows_of(self, handles: np.ndarray) -> np.ndarray:
        """The rows of these held requests (by handle), in one vectorised search: a step of steady decodes looks
        up its many rows without a dict lookup each. KeyError with the first handle it does not hold."""
        if self._index is None:
            rows = np.flatnonzero(self.held)
            order = np.argsort(self.handle[rows])
            self._index = (self.handle[rows][order], rows[order])
        held, rows = self._index
        at = np.searchsorted(held, handles)
        found = at < len(held)
        found[found] = held[at[found]] == handles[found]
        if not found.all():
            raise KeyError(int(handles[np.argmin(found)]))
        return rows[at]

    def append_blocks(self, state: RequestState, blocks: tuple[int, ...] | list[int]) -> None:
        n = int(self.num_blocks[state.row])
        self._fit(0, n + len(blocks))
        self.block_table[state.row, n : n + len(blocks)] = blocks
        self.num_blocks[state.row] = n + len(blocks)

    def set_block(self, state: RequestState, index: int, block: int) -> None:
        if not 0 <= index < self.num_blocks[state.row]:
            raise ValueError(f"request {state.handle}: block index {index} outside its {self.num_blocks[state.row]}")
        self.block_table[state.row, index] = block

    def append_tokens(self, state: RequestState, tokens: tuple[int, ...] | list[int]) -> None:
        n = len(state.token_ids)
        state.token_ids.extend(tokens)
        self._fit(n + len(tokens), 0)
        self.token_ids[state.row, n : n + len(tokens)] = tokens
        self.num_tokens[state.row] = n + len(tokens)

    def truncate(self, state: RequestState, n: int) -> None:
        """The request keeps its first n tokens (and at most n computed ones)."""
        del state.token_ids[n:]
        self.num_tokens[state.row] = n
        self.num_computed[state.row] = min(int(self.num_computed[state.row]), n)

    def clear_drafts(self) -> None:
        """Proposals live for one step: a step that did not compute them (skipped) leaves none behind."""
        if self.num_drafts.any():
            self.num_drafts[:] = 0

    def set_drafts(self, state: RequestState, drafts: tuple[int, ...] | list[int]) -> None:
        """Proposals to compute this step after the request's known tokens (speculative decoding); they become
        tokens only as far as they are accepted (`append_outputs`)."""
        n = len(state.token_ids)
        self._fit(n + len(drafts), 0)
        self.token_ids[state.row, n : n + len(drafts)] = drafts
        self.num_drafts[state.row] = len(drafts)

    def append_outputs(self, inputs: StepInputs, outputs: list[list[int]]) -> None:
        """Each sampler's tokens of a step with proposals: the accepted proposals and one more. The rejected
        proposals' slots are not computed after all: the computed tokens roll back to the accepted ones."""
        for state, tokens in zip(inputs.samplers, outputs):
            row = state.row
            drafts = int(self.num_drafts[row])
            if drafts:
                self.num_computed[row] -= drafts - (len(tokens) - 1)
                self.num_drafts[row] = 0
            self.append_tokens(state, tokens)

    def defer_drafts(self, inputs: StepInputs) -> None:
        """A step with proposals where sampled tokens travel in plans (P > 1 stages): no rank appends the
        accepted ones (the next plan brings them), and only the rank that samples knows how many there are, so
        every rank keeps its rows' proposals computed until the next plan says (`settle_unverified`)."""
        rows = inputs.rows
        self.num_unverified[rows] = self.num_drafts[rows]
        self.num_drafts[rows] = 0

    def settle_unverified(self, rows: np.ndarray, computed: np.ndarray) -> None:
        """The plan's computed tokens of its cached requests (in `rows`): a row whose proposals await it rolls
        back to that figure, its rejected proposals, if it is lower by at most its proposals; any other figure
        is left for the progress check to refuse."""
        pending = self.num_unverified[rows]
        if not pending.any():
            return
        back = self.num_computed[rows] - computed
        ok = (pending > 0) & (back >= 0) & (back <= pending)
        self.num_computed[rows[ok]] = computed[ok]
        self.num_unverified[rows] = 0

    def append_sampled(self, inputs: StepInputs, tokens: list[int]) -> None:
        """One sampled token for each of a step's samplers, at once."""
        if not tokens:
            return
        for state, token in zip(inputs.samplers, tokens):
            state.token_ids.append(token)
        rows = inputs.sampler_rows
        ends = self.num_tokens[rows]
        self._fit(int(ends.max()) + 1, 0)
        self.token_ids[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1

    def blocks(self, state: RequestState) -> list[int]:
        return self.block_table[state.row, : self.num_blocks[state.row]].tolist()

    def computed(self, state: RequestState) -> int:
        return int(self.num_computed[state.row])

    # ---- a step's inputs

    def gather(self, rows: np.ndarray, n: np.ndarray, compact_base: int) -> StepInputs:
        """The inputs of a step that computes n[i] tokens of the request in row rows[i], from its computed tokens
        on; advances their computed tokens (`restore` undoes it). Blocks from `compact_base` on are the compact
        pool's (0: no compact pool)."""
        compact = self.block_table[rows, 0] >= compact_base if compact_base else np.zeros(len(rows), dtype=bool)
        drafted = self.num_drafts[rows] > 0
        # Rows with proposals are verified as decodes: each of their tokens a query of its own over its prefix.
        key = compact * 2 + ((n != 1) & ~drafted)
        if key.any():  # full-pool decodes first, then prefills, then the compact pool's
            order = np.argsort(key, kind="stable")
            rows, n, compact, drafted = rows[order], n[order], compact[order], drafted[order]
        start = self.num_computed[rows]
        end = start + n
        held = self.num_tokens[rows] + self.num_drafts[rows]
        self._check(rows, end, held)
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        total = int(cu[-1])
        if total == len(rows):  # decodes only: one token each
            owner, positions = np.arange(len(rows)), start
        else:
            owner = np.repeat(np.arange(len(rows)), n)
            positions = np.arange(total) - cu[:-1][owner] + start[owner]
        ids = self.token_ids[rows[owner], positions].astype(np.int64)
        samples = end == held
        all_sample = total == len(rows) and bool(samples.all())
        sample_rows = cu[1:][samples] - 1
        sampler_rows = rows[samples]
        owners = self.owners
        samplers: list[RequestState] = [owners[r] for r in sampler_rows.tolist()]  # type: ignore[misc]
        flags = RowFlags(self.plain[sampler_rows], self.wants_logprobs[sampler_rows])
        draft_rows = None
        if self.num_drafts[sampler_rows].any():
            drafts = [self._drafts_of(s) for s in samplers]
            sample_rows, draft_rows = expand(samplers, flags, drafts, sample_rows)  # type: ignore[arg-type]
        prompt_rows = self._prompt_rows(rows, start, end, cu)
        pool_rows = self._pool_rows(rows, start, end, cu)
        self.num_computed[rows] = end
        num_full = int(len(rows) - compact.sum())
        full_tokens = int(cu[num_full])
        decode_like = (n == 1) | drafted
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
        dev = self.device
        return StepInputs(
            torch.from_numpy(ids).to(dev),
            torch.from_numpy(positions.astype(np.int64, copy=False)).to(dev),
            meta,
            torch.from_numpy(sample_rows).to(dev),
            all_sample,
            samplers,
            flags,
            sampler_rows,
            rows,
            start,
            prompt_rows,
            pool_rows,
            draft_rows,
        )

    def token_lora_slots(self, inputs: StepInputs) -> np.ndarray | None:
        """Each of a step's tokens' LoRA slot (-1: the base model), in batch order; None when none has one."""
        slots = self.lora_slot[inputs.rows]
        if not slots.any():
            return None
        counts = self.num_computed[inputs.rows] - inputs.starts  # gather advanced them by the step's tokens
        return np.repeat(slots - 1, counts)

    def _drafts_of(self, state: RequestState) -> list[int]:
        n = len(state.token_ids)
        return self.token_ids[state.row, n : n + int(self.num_drafts[state.row])].tolist()

    def restore(self, inputs: StepInputs) -> None:
        """The step did not run (interrupted): its requests' computed tokens are what they were, and their
        proposals are dropped."""
        self.num_computed[inputs.rows] = inputs.starts
        self.num_drafts[inputs.rows] = 0

    def _check(self, rows: np.ndarray, end: np.ndarray, held: np.ndarray) -> None:
        bad = np.flatnonzero(end > held)
        if len(bad):
            i = int(bad[0])
            state = self.owners[int(rows[i])]
            assert state is not None
            raise RuntimeError(f"request {state.handle}: the plan computes {end[i]} tokens, the worker holds {held[i]}")
        blocks = self.num_blocks[rows]
        short = np.flatnonzero(-(-end // self.block_size) > blocks)
        if len(short):
            i = int(short[0])
            state = self.owners[int(rows[i])]
            assert state is not None
            raise ValueError(f"request {state.handle}: {end[i]} tokens need more than its {blocks[i]} blocks")

    def _prompt_rows(
        self, rows: np.ndarray, start: np.ndarray, end: np.ndarray, cu: np.ndarray
    ) -> list[tuple[RequestState, int, int, int]]:
        """The prompt rows each request that asked for prompt logprobs scores this step (rows whose next token is
        the prompt's)."""
        wants = self.wants_prompt_logprobs[rows]
        if not wants.any():
            return []
        scored = np.minimum(end, self.num_prompt[rows] - 1) - start
        out = []
        for i in np.flatnonzero(wants & (scored > 0)).tolist():
            state = self.owners[int(rows[i])]
            assert state is not None
            out.append((state, int(cu[i]), int(scored[i]), int(start[i]) + 1))
        return out

    def _pool_rows(
        self, rows: np.ndarray, start: np.ndarray, end: np.ndarray, cu: np.ndarray
    ) -> list[tuple[RequestState, int, int, int]]:
        """The prompt rows each embedding request computes this step ("last" pooling: only the step that
        computes the prompt's last token)."""
        pools = self.pools[rows]
        if not pools.any():
            return []
        out = []
        for i in np.flatnonzero(pools).tolist():
            state = self.owners[int(rows[i])]
            assert state is not None
            count = min(int(end[i]), state.num_prompt_tokens) - int(start[i])
            if count > 0 and (state.sampling.pooling == "mean" or int(end[i]) >= state.num_prompt_tokens):
                out.append((state, int(cu[i]), count, int(start[i])))
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
        width = max(1, int(self.num_blocks[rows].max())) if len(rows) else 1
        tables = self.block_table[rows, :width]
        if base:  # the compact pool's own ids; the padding stays zero
            tables = np.where(np.arange(width) < self.num_blocks[rows][:, None], tables - base, 0).astype(np.int32)
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
        t = torch.from_numpy
        return AttentionMetadata(
            slot_mapping=t(slots).to(dev),
            num_decode_tokens=decode_tokens,
            decode_block_tables=t(decode_tables).to(dev),
            decode_seq_lens=t(decode_lens).to(dev),
            prefill_block_tables=t(tables[num_decodes:]).to(dev),
            prefill_cu_seqlens_q=t(cu_q).to(dev),
            prefill_seq_lens=t(lens[num_decodes:]).to(dev),
        )

    # ---- room

    def _fit(self, tokens: int, blocks: int) -> None:
        """Room for `tokens` token ids and `blocks` blocks in every row (doubling)."""
        if tokens > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, tokens)
        if blocks > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, blocks)

    def _grow_rows(self) -> None:
        old = len(self.owners)
        new = 2 * old
        self.owners += [None] * (new - old)
        self._free.extend(range(new - 1, old - 1, -1))
        for name in _ROW_ARRAYS:
            array = getattr(self, name)
            grown = np.zeros((new, *array.shape[1:]), dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)


def _widen(array: np.ndarray, width: int) -> np.ndarray:
    new = max(width, 2 * array.shape[1])
    grown = np.zeros((array.shape[0], new), dtype=array.dtype)
    grown[:, : array.shape[1]] = array
    return grown
