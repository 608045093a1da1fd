"""The worker's persistent input batch: rows written by a plan's diffs, a step's inputs gathered from them. Every
gathered tensor is checked against the inputs built the plain way (from each request's lists, in the order the
attention layers read them), over random mixes of decodes, prefill chunks and compact-pool requests, with rows
reused and arrays grown along the way."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from proto.wire import NewRequest, SamplingOptions
from worker_node.input_batch import InputBatch
from worker_node.step_inputs import StepInputs

pytestmark = pytest.mark.unit

BS = 4  # tokens per block: small, so requests cross blocks often
BASE = 1000  # block ids from here on are the compact pool's


@dataclass
class Held:
    """A request as the test keeps it: plain lists."""

    handle: int
    tokens: list[int]
    blocks: list[int]
    computed: int


def _new(handle: int, rng: random.Random, compact: bool = False, prompt_logprobs: int | None = None) -> NewRequest:
    tokens = [rng.randrange(5, 500) for _ in range(rng.randint(1, 30))]
    first = BASE if compact else 0
    blocks = [first + rng.randrange(0, 500) for _ in range(-(-len(tokens) // BS))]
    options = SamplingOptions(temperature=0.0, prompt_logprobs=prompt_logprobs)
    return NewRequest(handle, tokens, [], options, blocks, rng.randrange(0, len(tokens)), 1)


def _expected(held: list[Held], counts: list[int]) -> dict:
    """The inputs the plain way: full-pool requests then compact ones; in each, decodes then prefill chunks."""
    work = sorted(zip(held, counts), key=lambda w: (w[0].blocks[0] >= BASE, w[1] != 1))
    ids, positions, slots, lens, tables, sample_rows, samplers = [], [], [], [], [], [], []
    for h, n in work:
        start, end = h.computed, h.computed + n
        ids += h.tokens[start:end]
        positions += list(range(start, end))
        own = [b - BASE for b in h.blocks] if h.blocks[0] >= BASE else h.blocks
        slots += [own[p // BS] * BS + p % BS for p in range(start, end)]
        lens.append(end)
        tables.append(own)
        if end == len(h.tokens):
            sample_rows.append(len(ids) - 1)
            samplers.append(h.handle)
    return {
        "ids": ids,
        "positions": positions,
        "slots": slots,
        "lens": lens,
        "tables": tables,
        "sample_rows": sample_rows,
        "samplers": samplers,
    }


def _got(inputs: StepInputs) -> dict:
    metas = [inputs.meta] + ([inputs.meta.compact] if inputs.meta.compact is not None else [])
    slots, lens, tables = [], [], []
    for m in metas:
        slots += m.slot_mapping.tolist()
        lens += m.decode_seq_lens.tolist() + m.prefill_seq_lens.tolist()
        for t in (m.decode_block_tables, m.prefill_block_tables):
            tables += t.tolist()
    return {
        "ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slots": slots,
        "lens": lens,
        "tables": tables,
        "sample_rows": inputs.sample_rows.tolist(),
        "samplers": [s.handle for s in inputs.samplers],
    }


def _same_tables(got: list[list[int]], want: list[list[int]]) -> bool:
    """Each gathered table is the request's blocks, padded with zeros."""
    return len(got) == len(want) and all(g[: len(w)] == w and not any(g[len(w) :]) for g, w in zip(got, want))


def test_gathered_inputs_match_the_plain_ones_over_random_steps() -> None:
    rng = random.Random(0)
    batch = InputBatch(BS, torch.device("cpu"), rows=2)  # grows rows, token and block widths as it goes
    held: dict[int, Held] = {}
    next_handle = 0
    for _ in range(60):
        for gone in rng.sample(sorted(held), k=min(len(held), rng.randint(0, 2))):  # finished: rows are reused
            batch.remove(gone)
            del held[gone]
        for _ in range(rng.randint(0, 3)):
            new = _new(next_handle, rng, compact=rng.random() < 0.3)
            batch.add(new)
            held[next_handle] = Held(
                next_handle, list(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens
            )
            next_handle += 1
        for h in held.values():  # more tokens (as with tokens in the plan) and the blocks they need
            extra = [rng.randrange(5, 500) for _ in range(rng.randint(0, 3))]
            state = batch.states[h.handle]
            batch.append_tokens(state, extra)
            h.tokens += extra
            grown = [
                (BASE if h.blocks[0] >= BASE else 0) + rng.randrange(500)
                for _ in range(len(h.blocks), -(-len(h.tokens) // BS))
            ]
            batch.append_blocks(state, grown)
            h.blocks += grown
        chosen = [h for h in held.values() if h.computed < len(h.tokens)]
        if not chosen:
            continue
        counts = [rng.choice([1, len(h.tokens) - h.computed]) for h in chosen]
        rows = np.array([batch.states[h.handle].row for h in chosen], dtype=np.int64)
        inputs = batch.gather(rows, np.array(counts, dtype=np.int64), BASE)
        want, got = _expected(chosen, counts), _got(inputs)
        assert _same_tables(got.pop("tables"), want.pop("tables"))
        assert got == want
        if rng.random() < 0.2:  # interrupted: nothing advanced
            batch.restore(inputs)
            assert [batch.computed(batch.states[h.handle]) for h in chosen] == [h.computed for h in chosen]
        else:
            for h, n in zip(chosen, counts):
                h.computed += n
                assert batch.computed(batch.states[h.handle]) == h.computed


def test_block_table_padding_is_zero_after_a_row_is_reused() -> None:
    """A wide request leaves its row; a short one takes it: its table's padding is zeros, not the old blocks."""
    batch = InputBatch(BS, torch.device("cpu"), rows=1)
    wide = NewRequest(1, list(range(40)), [], SamplingOptions(), list(range(100, 110)), 39, 1)
    short = NewRequest(2, list(range(4)), [], SamplingOptions(), [7], 3, 1)
    other = NewRequest(3, list(range(40)), [], SamplingOptions(), list(range(200, 210)), 39, 1)
    batch.add(wide)
    batch.remove(1)
    batch.add(short)
    batch.add(other)  # a second row; the batch's table is as wide as its widest request
    rows = np.array([batch.states[2].row, batch.states[3].row], dtype=np.int64)
    inputs = batch.gather(rows, np.array([1, 1], dtype=np.int64), 0)
    assert inputs.meta.decode_block_tables.tolist()[0] == [7] + [0] * 9


def test_sampled_tokens_land_in_the_rows_and_the_lists() -> None:
    batch = InputBatch(BS, torch.device("cpu"))
    for handle in range(3):
        batch.add(NewRequest(handle, [5, 6, 7], [], SamplingOptions(), [handle], 2, 1))
    rows = np.array([batch.states[h].row for h in range(3)], dtype=np.int64)
    inputs = batch.gather(rows, np.ones(3, dtype=np.int64), 0)
    batch.append_sampled(inputs, [40, 41, 42])
    assert [batch.states[h].token_ids for h in range(3)] == [[5, 6, 7, 40], [5, 6, 7, 41], [5, 6, 7, 42]]
    inputs = batch.gather(rows, np.ones(3, dtype=np.int64), 0)  # the next decode reads the sampled tokens
    assert inputs.input_ids.tolist() == [40, 41, 42]
    assert inputs.positions.tolist() == [3, 3, 3]


def test_prompt_logprob_rows_only_for_requests_that_asked() -> None:
    batch = InputBatch(BS, torch.device("cpu"))
    asks = NewRequest(1, list(range(10, 22)), [], SamplingOptions(prompt_logprobs=2), [0, 1, 2], 0, 12)
    silent = NewRequest(2, list(range(10, 22)), [], SamplingOptions(), [3, 4, 5], 0, 12)
    resumed = NewRequest(3, list(range(10, 22)), [30], SamplingOptions(prompt_logprobs=2), [6, 7, 8, 9], 0, 13)
    for r in (asks, silent, resumed):
        batch.add(r)
    rows = np.array([batch.states[h].row for h in (1, 2, 3)], dtype=np.int64)
    inputs = batch.gather(rows, np.array([5, 12, 13], dtype=np.int64), 0)
    # the first 5 prompt tokens of request 1: rows 0..4 score the prompt's tokens 1..5
    assert [(s.handle, first_row, count, first) for s, first_row, count, first in inputs.prompt_rows] == [(1, 0, 5, 1)]


def test_out_of_range_block_index_is_an_error() -> None:
    batch = InputBatch(BS, torch.device("cpu"))
    state = batch.add(NewRequest(1, [5, 6], [], SamplingOptions(), [3], 0, 2))
    with pytest.raises(ValueError, match="block index 1"):
        batch.set_block(state, 1, 9)
    batch.set_block(state, 0, 9)
    assert batch.blocks(state) == [9]


def test_unverified_proposals_roll_back_to_the_next_plan_only_downwards_by_at_most_their_count() -> None:
    """Tokens in plans (P > 1 stages): a rank keeps a verified row's proposals computed until the request's next
    plan says how many were accepted; it rolls back to that figure only if it is lower by at most its proposals
    (any other figure stays, for the progress check to refuse), and only once."""
    batch = InputBatch(BS, torch.device("cpu"))
    states = [batch.add(NewRequest(h, [5, 6, 7, 8, 9], [], SamplingOptions(), [h, 10 + h], 4, 1)) for h in range(4)]
    rows = np.array([s.row for s in states], dtype=np.int64)
    for s in states:
        batch.set_drafts(s, [20, 21, 22])
    inputs = batch.gather(rows, np.full(4, 4, dtype=np.int64), 0)
    assert inputs.draft_rows is not None and batch.rows.num_computed[rows].tolist() == [8, 8, 8, 8]
    batch.defer_drafts(inputs)
    assert not batch.rows.num_drafts[rows].any()
    # 2 accepted, all 3, rolled back by 4 (more than its proposals), and a figure above what the row computed
    batch.settle_unverified(rows, np.array([7, 8, 4, 9], dtype=np.int64))
    assert batch.rows.num_computed[rows].tolist() == [7, 8, 8, 8]
    batch.settle_unverified(rows, np.array([6, 6, 6, 6], dtype=np.int64))  # settled already: nothing to roll back
    assert batch.rows.num_computed[rows].tolist() == [7, 8, 8, 8]


def test_rows_of_finds_held_handles_as_requests_come_and_go() -> None:
    """A plan's packed decodes are looked up in one search (`rows_of`): right after requests came and went, in any
    order, and a handle the worker does not hold is a KeyError naming it, never another request's row."""
    batch = InputBatch(BS, torch.device("cpu"), rows=2)  # rows grow as requests come
    for handle in (7, 3, 90, 12):
        batch.add(NewRequest(handle, [5, 6], [], SamplingOptions(), [handle], 1, 1))
    rows = {h: batch.states[h].row for h in (7, 3, 90, 12)}
    assert batch.rows_of(np.array([90, 3, 12, 7])).tolist() == [rows[90], rows[3], rows[12], rows[7]]
    batch.remove(3)
    batch.add(NewRequest(5, [5, 6], [], SamplingOptions(), [5], 1, 1))  # takes the freed row
    assert batch.rows_of(np.array([5, 12])).tolist() == [batch.states[5].row, rows[12]]
    for missing in ([3], [12, 4], [1000], [0]):
        with pytest.raises(KeyError) as err:
            batch.rows_of(np.array(missing))
        assert err.value.args[0] == [h for h in missing if h not in batch.states][0]
    assert batch.rows_of(np.array([], dtype=np.int64)).tolist() == []
