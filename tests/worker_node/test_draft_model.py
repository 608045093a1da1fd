"""The draft model's proposals (speculative decoding, worker_node/draft_model.py): its own KV cache rolled back to
the tokens it shares with the target, and room for the requests that ask."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.backend import select_attention_backend
from proto.wire import SamplingOptions
from worker_node.draft_model import DraftModel, load_draft
from worker_node.input_batch import RequestState

pytestmark = pytest.mark.model

CPU = torch.device("cpu")


def draft(folder: Path, max_seqs: int = 2, max_model_len: int = 64) -> DraftModel:
    backend = select_attention_backend("auto", CPU)
    return load_draft(str(folder), 49152, backend, torch.float32, CPU, max_model_len, 16, 3, max_seqs)


def target(handle: int, tokens: list[int]) -> RequestState:
    return RequestState(handle, list(tokens), 4, SamplingOptions(temperature=0.0), row=handle)


def test_proposals_after_a_rollback_are_a_fresh_drafts(tiny_llama_dir: Path) -> None:
    """Proposals rejected in part: the draft's cache keeps only the shared prefix, and what it proposes next is what
    a draft that never saw the rejected tokens proposes."""
    d = draft(tiny_llama_dir)
    prompt = [11, 12, 13, 14, 15, 16, 17]
    first = d.propose([target(0, prompt)])[0]
    assert len(first) == 3
    accepted = prompt + first[:1] + [999]  # the first proposal accepted, the second replaced
    again = d.propose([target(0, accepted)])[0]
    assert d.batch.computed(d.batch.states[0]) == len(accepted) + 2  # its own proposals but the last
    assert again == draft(tiny_llama_dir).propose([target(0, accepted)])[0]
    all_of_them = accepted + again + [5]
    assert d.propose([target(0, all_of_them)])[0] == draft(tiny_llama_dir).propose([target(0, all_of_them)])[0]


def test_short_of_blocks_it_drops_idle_requests_then_proposes_nothing(tiny_llama_dir: Path) -> None:
    d = draft(tiny_llama_dir, max_seqs=1, max_model_len=29)  # 2 blocks of 16: one request of up to 29 + 3 tokens
    assert d.propose([target(0, list(range(20, 40)))])[0]
    assert d.propose([target(1, list(range(40, 60)))])[1]  # request 0 no longer asks: its blocks go to request 1
    assert list(d.batch.states) == [1]
    both = d.propose([target(1, list(range(40, 61))), target(2, list(range(60, 80)))])
    assert both[1] and 2 not in both and list(d.batch.states) == [1]
    d.forget([1])
    assert not d.batch.states and len(d._free) == 2
