"""A model that costs nothing: the worker's side of what scheduler_node/engine/stand_in.py is to the engine.

`ZeroCostModel` takes a decoder's place behind the ModelRunner: its forward pass returns hidden states of the
right shape and its LM head logits of the right shape, both views of buffers made once, so a step costs only what
the worker does around the model (the plan's diffs, input preparation, the sampler, the reply). Each logits row's
largest entry sits on an ordinary text token (one per row, past the tokenizer's specials and single bytes), so a
greedy sampler picks real words and the detokenizer does its real work. scripts/bench_overhead.py measures the
host's cost per step with it. The sampler may write sampled rows in place: the buffer is shared between steps, so
only greedy requests are meant to run on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker_node.models.config import ModelConfig

FIRST_WORD = 256  # SmolLM2's specials and single bytes come before this id


class ZeroCostModel(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        if vocab_size <= FIRST_WORD:
            raise ValueError(f"vocab_size: must be over {FIRST_WORD}, got {vocab_size}")
        self.config = dataclasses.replace(config, vocab_size=vocab_size)
        self.anchor = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)  # the runner reads a dtype
        self.device = device
        self._hidden = torch.zeros(0, config.hidden_size, device=device)
        self._logits = torch.zeros(0, vocab_size, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        meta: Any,
        hidden: torch.Tensor | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        rows = input_ids.shape[0]
        if rows > self._hidden.shape[0]:
            self._hidden = torch.zeros(2 * rows, self.config.hidden_size, device=self.device)
        return self._hidden[:rows]

    def use_native_decode(self, on: bool, time_phases: bool = False) -> None:
        """CausalLM's switch of the C decode runner: this model has no layers to run."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows > self._logits.shape[0]:
            self._logits = _planted_logits(2 * rows, self.config.vocab_size, self.device)
        return self._logits[:rows]


def _planted_logits(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=generator)
    words = FIRST_WORD + (torch.arange(rows) * 37) % (vocab - FIRST_WORD)
    logits[torch.arange(rows), words] = 100.0
    return logits.to(device)


def zero_cost_loader(vocab_size: int) -> Callable[..., ZeroCostModel]:
    """A stand-in for worker_node.models.loader.load_model (same arguments): reads only the folder's config."""

    def load(
        folder: str | Path, backend: Any, dtype: torch.dtype, device: torch.device, *rest: Any, **options: Any
    ) -> ZeroCostModel:
        return ZeroCostModel(ModelConfig.from_folder(folder), vocab_size, device)

    return load
