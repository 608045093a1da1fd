"""The requests a worker holds, as rows of preallocated arrays (worker_node/batch_rows.py); a step's inputs are
gathered from them in a few vectorised operations (worker_node/step_inputs.py's StepGather, which the batch is
composed of).

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

from collections.abc import Iterator

import numpy as np
import torch

from proto.wire import NewRequest
from worker_node.batch_rows import BatchRows, RequestState
from worker_node.sampler import is_plain, runs_on_device
from worker_node.step_inputs import StepGather, StepInputs

__all__ = ["InputBatch", "RequestState"]


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, rows: int = 64) -> None:
        self.block_size = block_size
        self.device = device
        self.rows = BatchRows(rows)  # the arrays: this object writes them, its StepGather reads them
        self.inputs = StepGather(self.rows, block_size, device)
        self.states: dict[int, RequestState] = {}  # by handle
        self._free = list(range(rows - 1, -1, -1))
        # The held handles sorted, and their rows: `rows_of` looks a plan's packed decodes up in them with one
        # search. Rebuilt (vectorised) on the first lookup after a request came or went; None until then.
        self._index: tuple[np.ndarray, np.ndarray] | None = None

    # ---- a step's inputs (worker_node/step_inputs.py)

    def gather(self, rows: np.ndarray, n: np.ndarray, compact_base: int) -> StepInputs:
        """The inputs of a step that computes n[i] tokens of the request in row rows[i], from its computed tokens
        on; advances their computed tokens (`restore` undoes it). Blocks from `compact_base` on are the compact
        pool's (0: no compact pool)."""
        return self.inputs.gather(rows, n, compact_base)

    def restore(self, inputs: StepInputs) -> None:
        """The step did not run (interrupted): its requests' computed tokens are what they were, and their
        proposals are dropped."""
        r = self.rows
        r.num_computed[inputs.rows] = inputs.starts
        r.num_drafts[inputs.rows] = 0

    # ---- rows: written by a plan's diffs

    def add(self, r: NewRequest) -> RequestState:
        """A request the plan brings in full (new, or back after preemption): a row of its own."""
        self.remove(r.handle)  # a handle sent again in full starts over
        tokens = r.prompt_token_ids + r.output_token_ids
        if not self._free:
            self._free.extend(reversed(self.rows.grow()))
        row = self._free.pop()
        a = self.rows
        a.fit(len(tokens), len(r.block_ids))
        state = RequestState(
            r.handle, tokens, len(r.prompt_token_ids), r.sampling, row, bool(r.output_token_ids), tuple(r.images)
        )
        self.states[r.handle] = a.owners[row] = state
        a.token_ids[row, : len(tokens)] = tokens
        a.num_tokens[row] = len(tokens)
        a.num_computed[row] = r.num_computed_tokens
        a.num_prompt[row] = len(r.prompt_token_ids)
        a.block_table[row] = 0
        a.block_table[row, : len(r.block_ids)] = r.block_ids
        a.num_blocks[row] = len(r.block_ids)
        a.wants_prompt_logprobs[row] = r.sampling.prompt_logprobs is not None and not state.resumed
        a.plain[row] = is_plain(r.sampling)
        a.on_device[row] = runs_on_device(r.sampling)
        a.wants_logprobs[row] = r.sampling.logprobs is not None
        a.pools[row] = bool(r.sampling.pooling)
        a.has_images[row] = bool(r.images)
        a.lora_slot[row] = 0 if r.lora is None else r.lora.slot + 1
        a.num_drafts[row] = 0
        a.num_unverified[row] = 0
        a.handle[row] = r.handle
        a.held[row] = True
        self._index = None
        return state

    def remove(self, handle: int) -> None:
        state = self.states.pop(handle, None)
        if state is not None:
            self.rows.owners[state.row] = None
            self.rows.held[state.row] = False
            self._free.append(state.row)
            self._index = None

    def rows_of(self, handles: np.ndarray) -> np.ndarray:
        """The rows of these held requests (by handle), in one vectorised search: a step of steady decodes looks
        up its many rows without a dict lookup each. KeyError with the first handle it does not hold."""
        if self._index is None:
            a = self.rows
            rows = np.flatnonzero(a.held)
            order = np.argsort(a.handle[rows])
            self._index = (a.handle[rows][order], rows[order])
        held, rows = self._index
        at = np.searchsorted(held, handles)
        found = at < len(held)
        found[found] = held[at[found]] == handles[found]
        if not found.all():
            raise KeyError(int(handles[np.argmin(found)]))
        return rows[at]

    def append_blocks(self, state: RequestState, blocks: tuple[int, ...] | list[int]) -> None:
        a = self.rows
        n = int(a.num_blocks[state.row])
        a.fit(0, n + len(blocks))
        a.block_table[state.row, n : n + len(blocks)] = blocks
        a.num_blocks[state.row] = n + len(blocks)

    def set_block(self, state: RequestState, index: int, block: int) -> None:
        a = self.rows
        if not 0 <= index < a.num_blocks[state.row]:
            raise ValueError(f"request {state.handle}: block index {index} outside its {a.num_blocks[state.row]}")
        a.block_table[state.row, index] = block

    def append_tokens(self, state: RequestState, tokens: tuple[int, ...] | list[int]) -> None:
        a = self.rows
        n = len(state.token_ids)
        state.token_ids.extend(tokens)
        a.fit(n + len(tokens), 0)
        a.token_ids[state.row, n : n + len(tokens)] = tokens
        a.num_tokens[state.row] = n + len(tokens)

    def truncate(self, state: RequestState, n: int) -> None:
        """The request keeps its first n tokens (and at most n computed ones)."""
        a = self.rows
        del state.token_ids[n:]
        a.num_tokens[state.row] = n
        a.num_computed[state.row] = min(int(a.num_computed[state.row]), n)

    # ---- proposals (speculative decoding)

    def clear_drafts(self) -> None:
        """Proposals live for one step: a step that did not compute them (skipped) leaves none behind."""
        if self.rows.num_drafts.any():
            self.rows.num_drafts[:] = 0

    def set_drafts(self, state: RequestState, drafts: tuple[int, ...] | list[int]) -> None:
        """Proposals to compute this step after the request's known tokens (speculative decoding); they become
        tokens only as far as they are accepted (`append_outputs`)."""
        a = self.rows
        n = len(state.token_ids)
        a.fit(n + len(drafts), 0)
        a.token_ids[state.row, n : n + len(drafts)] = drafts
        a.num_drafts[state.row] = len(drafts)

    def append_outputs(self, inputs: StepInputs, outputs: list[list[int]]) -> None:
        """Each sampler's tokens of a step with proposals: the accepted proposals and one more. The rejected
        proposals' slots are not computed after all: the computed tokens roll back to the accepted ones."""
        a = self.rows
        for state, tokens in zip(inputs.samplers, outputs):
            row = state.row
            drafts = int(a.num_drafts[row])
            if drafts:
                a.num_computed[row] -= drafts - (len(tokens) - 1)
                a.num_drafts[row] = 0
            self.append_tokens(state, tokens)

    def defer_drafts(self, inputs: StepInputs) -> None:
        """A step with proposals where sampled tokens travel in plans (P > 1 stages): no rank appends the
        accepted ones (the next plan brings them), and only the rank that samples knows how many there are, so
        every rank keeps its rows' proposals computed until the next plan says (`settle_unverified`)."""
        a, rows = self.rows, inputs.rows
        a.num_unverified[rows] = a.num_drafts[rows]
        a.num_drafts[rows] = 0

    def settle_unverified(self, rows: np.ndarray, computed: np.ndarray) -> None:
        """The plan's computed tokens of its cached requests (in `rows`): a row whose proposals await it rolls
        back to that figure, its rejected proposals, if it is lower by at most its proposals; any other figure
        is left for the progress check to refuse."""
        a = self.rows
        pending = a.num_unverified[rows]
        if not pending.any():
            return
        back = a.num_computed[rows] - computed
        ok = (pending > 0) & (back >= 0) & (back <= pending)
        a.num_computed[rows[ok]] = computed[ok]
        a.num_unverified[rows] = 0

    # ---- a step's tokens

    def append_sampled(self, inputs: StepInputs, tokens: list[int]) -> None:
        """One sampled token for each of a step's samplers, at once."""
        if not tokens:
            return
        for state, token in zip(inputs.samplers, tokens):
            state.token_ids.append(token)
        a, rows = self.rows, inputs.sampler_rows
        ends = a.num_tokens[rows]
        a.fit(int(ends.max()) + 1, 0)
        a.token_ids[rows, ends] = tokens
        a.num_tokens[rows] = ends + 1

    def reserve(self, inputs: StepInputs, tokens: torch.Tensor) -> list[tuple[RequestState, int]]:
        """A step's samplers get their tokens' places before the host knows them: `tokens` (on the device) is
        their tokens, and each row holds the placeholder -(i + 1) for its token i until `fill` (the next step's
        `gather` reads such a token from the device). Returns each sampler with its token's position."""
        places = []
        for i, state in enumerate(inputs.samplers):
            places.append((state, len(state.token_ids)))
            state.token_ids.append(-(i + 1))
        a, rows = self.rows, inputs.sampler_rows
        ends = a.num_tokens[rows]
        a.fit(int(ends.max()) + 1, 0)
        a.token_ids[rows, ends] = -np.arange(1, len(rows) + 1, dtype=np.int32)
        a.num_tokens[rows] = ends + 1
        a.in_flight = tokens
        return places

    def fill(self, places: list[tuple[RequestState, int]], tokens: list[int], launched: torch.Tensor) -> None:
        """The host has a reserved step's tokens (`launched`: as `reserve` was given them): each goes in its place,
        for the requests this batch still holds as they were (a later plan may have finished or preempted one, or
        given its row to another)."""
        a = self.rows
        owners = a.owners
        for (state, position), token in zip(places, tokens):
            if owners[state.row] is state and state.token_ids[position] < 0:
                state.token_ids[position] = token
                a.token_ids[state.row, position] = token
        if a.in_flight is launched:
            a.in_flight = None

    # ---- reads

    def held_blocks(self) -> Iterator[tuple[int, list[int]]]:
        """Each held request's handle with its blocks (what a failed KV load checks against)."""
        return ((handle, self.blocks(state)) for handle, state in self.states.items())

    def blocks(self, state: RequestState) -> list[int]:
        return self.rows.block_table[state.row, : self.rows.num_blocks[state.row]].tolist()

    def computed(self, state: RequestState) -> int:
        return int(self.rows.num_computed[state.row])

    def handles(self, rows: np.ndarray) -> bytes:
        """The handles of the requests in these rows, as the wire packs them (StepResult.token_handles)."""
        return self.rows.handle[rows].astype("<i4").tobytes()

    def on_device(self, rows: np.ndarray) -> bool:
        """Whether every one of these rows' tokens needs nothing of the host (sampler.runs_on_device)."""
        return bool(self.rows.on_device[rows].all())
