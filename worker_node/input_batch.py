"""The requests a worker holds, as rows of preallocated arrays; a step's inputs are gathered from them in a few
vectorised operations (worker_node/step_inputs.py, a part of InputBatch).

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

import numpy as np
import torch

from proto.wire import NewRequest
from worker_node.sampler import is_plain, runs_on_device
from worker_node.step_inputs import RequestState, StepGather, StepInputs

_ROW_ARRAYS = (
    "token_ids", "num_tokens", "num_computed", "num_prompt", "block_table", "num_blocks", "wants_prompt_logprobs",
    "plain", "on_device", "wants_logprobs", "pools", "num_drafts", "num_unverified", "lora_slot", "handle", "held",
)  # fmt: skip


class InputBatch(StepGather):
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
        self.on_device = np.zeros(rows, dtype=bool)  # its token needs nothing of the host (sampler.runs_on_device)
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
        # The tokens of the last step launched before the host read them (worker_node/step_overlap.py): until then
        # its samplers' rows hold a placeholder -(i + 1) for token i of this tensor, which `gather` reads here.
        self.in_flight: torch.Tensor | None = None

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
        self.on_device[row] = runs_on_device(r.sampling)
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

    def reserve(self, inputs: StepInputs, tokens: torch.Tensor) -> list[tuple[RequestState, int]]:
        """A step's samplers get their tokens' places before the host knows them: `tokens` (on the device) is
        their tokens, and each row holds the placeholder -(i + 1) for its token i until `fill` (the next step's
        `gather` reads such a token from the device). Returns each sampler with its token's position."""
        places = []
        for i, state in enumerate(inputs.samplers):
            places.append((state, len(state.token_ids)))
            state.token_ids.append(-(i + 1))
        rows = inputs.sampler_rows
        ends = self.num_tokens[rows]
        self._fit(int(ends.max()) + 1, 0)
        self.token_ids[rows, ends] = -np.arange(1, len(rows) + 1, dtype=np.int32)
        self.num_tokens[rows] = ends + 1
        self.in_flight = tokens
        return places

    def fill(self, places: list[tuple[RequestState, int]], tokens: list[int], launched: torch.Tensor) -> None:
        """The host has a reserved step's tokens (`launched`: as `reserve` was given them): each goes in its place,
        for the requests this batch still holds as they were (a later plan may have finished or preempted one, or
        given its row to another)."""
        owners = self.owners
        for (state, position), token in zip(places, tokens):
            if owners[state.row] is state and state.token_ids[position] < 0:
                state.token_ids[position] = token
                self.token_ids[state.row, position] = token
        if self.in_flight is launched:
            self.in_flight = None

    def blocks(self, state: RequestState) -> list[int]:
        return self.block_table[state.row, : self.num_blocks[state.row]].tolist()

    def computed(self, state: RequestState) -> int:
        return int(self.num_computed[state.row])

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
