"""A draft model's proposals (speculative decoding, `{"method": "draft_model", "model": PATH}`).

The draft is a smaller model with the target's vocabulary. After a step, for each request the plan asked proposals
for (`StepPlan.propose`), it catches up on the request's tokens (the target's, accepted ones included) and decodes
k tokens greedily; those travel back in the result (`StepResult.drafts`) and the scheduler puts them in the
request's next plan, where the target verifies them as it verifies any proposals (worker_node/spec_decode.py): a
greedy draft's tokens are a point mass, so the output is the target's whatever the draft says.

It runs on the rank that samples (TP rank 0 of the last stage), at TP 1 with a KV cache of its own: its proposals
reach the other ranks in the next plan like n-gram ones, so running it on every rank would repeat the same work;
the other ranks wait for that plan a draft's few small forwards longer.

Its cache is paged like the target's, with blocks of its own: each request keeps its draft blocks while it
speculates; a request's draft state is rolled back to the longest prefix its tokens still share with the target's
(rejected proposals), and dropped when the request leaves, or when the blocks run short for the requests asking.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kernels.interface import AttentionBackend
from proto.wire import NewRequest, SamplingOptions
from worker_node.input_batch import InputBatch, RequestState
from worker_node.kv.cache import KVCache, allocate_kv_cache
from worker_node.models.config import ModelConfig
from worker_node.models.decoder import CausalLM
from worker_node.models.loader import load_model
from worker_node.sampler import argmax

logger = logging.getLogger(__name__)

GREEDY = SamplingOptions(temperature=0.0)


class DraftModel:
    def __init__(self, model: CausalLM, kv_cache: KVCache, block_size: int, device: torch.device, k: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.k = k  # tokens proposed per request and step
        self.batch = InputBatch(block_size, device)  # the draft's own rows, by the target's handles
        self._free = list(range(kv_cache[0].num_blocks - 1, -1, -1))

    def forget(self, handles: list[int]) -> None:
        """Requests that left (finished, aborted, preempted): their draft blocks are free again."""
        for handle in handles:
            state = self.batch.states.get(handle)
            if state is not None:
                self._free += self.batch.blocks(state)
                self.batch.remove(handle)

    @torch.inference_mode()
    def propose(self, targets: list[RequestState], pending: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
        """k greedy tokens of the draft after each of these requests' tokens (the target's rows, as they are now,
        then their `pending` tokens: sampled this step, not yet in the rows where tokens travel in plans); a
        request the draft's cache has no room for proposes nothing."""
        asking = {s.handle for s in targets}
        states = [s for t in targets if (s := self._sync(t, asking, pending)) is not None]
        if not states:
            return {}
        rows = np.array([s.row for s in states], dtype=np.int64)
        batch = self.batch
        # Catch up (a prompt the first time), then one token each.
        counts = batch.rows.num_tokens[rows] - batch.rows.num_computed[rows]
        out: dict[int, list[int]] = {s.handle: [] for s in states}
        for _ in range(self.k):
            inputs = batch.gather(rows, counts, 0)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, None)
            logits = self.model.logits(hidden if inputs.all_sample else hidden[inputs.sample_rows])
            assert logits is not None, "the draft runs at TP 1: it always has its logits"
            for state, token in zip(inputs.samplers, argmax(logits).tolist()):
                out[state.handle].append(token)
                batch.append_tokens(state, [token])
            counts = np.ones(len(rows), dtype=np.int64)
        return out

    def _sync(
        self, target: RequestState, asking: set[int], pending: dict[int, list[int]] | None
    ) -> RequestState | None:
        """The draft's row of `target`, its tokens made the target's (and its `pending` ones): its computed
        tokens roll back to the prefix both share (its proposals the target rejected); with blocks for k more
        tokens. None: no room."""
        batch, tokens = self.batch, target.token_ids
        if pending is not None:
            tokens = tokens + pending.get(target.handle, [])
        state = batch.states.get(target.handle)
        if state is None:
            state = batch.add(NewRequest(target.handle, list(tokens), [], GREEDY, [], 0, 1))
        else:
            mine = state.token_ids
            # At least its last token is computed again: the step needs a row to sample from.
            limit = min(len(mine), len(tokens) - 1, batch.computed(state))
            start = max(0, limit - 2 * self.k - 2)  # only its last tokens can differ: the rest the target accepted
            if mine[:start] != tokens[:start]:  # a request sent again in full after a preemption, say
                start = 0
            shared = start
            while shared < limit and mine[shared] == tokens[shared]:
                shared += 1
            batch.truncate(state, shared)
            batch.append_tokens(state, tokens[shared:])
        need = -(-(len(tokens) + self.k) // self.block_size) - int(batch.rows.num_blocks[state.row])
        if need > len(self._free):
            self._evict(asking)
        if need > len(self._free):
            self.forget([target.handle])
            return None
        if need > 0:
            batch.append_blocks(state, [self._free.pop() for _ in range(need)])
        return state

    def _evict(self, keep: set[int]) -> None:
        """Short of blocks: the draft state of requests not asking for proposals now goes (they catch up again
        when they next ask)."""
        gone = [h for h in self.batch.states if h not in keep]
        if gone:
            logger.debug("draft KV cache full: dropping the draft state of %d request(s)", len(gone))
            self.forget(gone)


def load_draft(
    folder: str,
    target_vocab: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    block_size: int,
    k: int,
    max_seqs: int,
    huge_pages: bool = True,
) -> DraftModel:
    """The draft model at TP 1, with a KV cache for `max_seqs` requests of `max_model_len` tokens and k more
    (`huge_pages`: as load_model's)."""
    config = ModelConfig.from_folder(folder)
    if config.vocab_size != target_vocab:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({config.vocab_size} tokens, {folder}) is not the "
            f"target's ({target_vocab})"
        )
    model = load_model(folder, backend, dtype, device, max_model_len + k, huge_pages=huge_pages)
    per_seq = -(-(max_model_len + k) // block_size)
    cache = allocate_kv_cache(config, block_size, dtype, device, max(1, max_seqs) * per_seq)
    return DraftModel(model, cache, block_size, device, k)
