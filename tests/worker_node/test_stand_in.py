"""The zero-cost model of scripts/bench_overhead.py: the shapes a runner expects, logits whose argmax is a word
token past the specials and bytes, buffers reused (no per-step allocation), and a vocabulary too small refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker_node.models.config import ModelConfig
from worker_node.stand_in import FIRST_WORD, ZeroCostModel, zero_cost_loader

pytestmark = pytest.mark.model


def test_shapes_argmax_and_reuse(tiny_llama_dir: Path) -> None:
    model = zero_cost_loader(1024)(tiny_llama_dir, None, torch.float32, torch.device("cpu"))
    assert model.config.vocab_size == 1024
    hidden = model(torch.zeros(5, dtype=torch.long), torch.arange(5), [], None)
    assert hidden.shape == (5, model.config.hidden_size)
    logits = model.logits(hidden)
    assert logits.shape == (5, 1024)
    assert bool((logits.argmax(-1) >= FIRST_WORD).all()), "every greedy token is an ordinary word"
    again = model.logits(model(torch.zeros(3, dtype=torch.long), torch.arange(3), [], None))
    assert again.data_ptr() == logits.data_ptr(), "a smaller step reuses the buffers"


def test_a_vocabulary_without_words_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        ZeroCostModel(ModelConfig.from_folder(tiny_llama_dir), FIRST_WORD, torch.device("cpu"))
