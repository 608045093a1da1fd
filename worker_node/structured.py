"""Structured output on the worker: one llguidance matcher per constrained request, masks computed off the
critical path.

The matcher follows the request's own token list: before each mask it consumes the output tokens appended since
(sampled here, or sent in the plan with P > 1 stages), so it is advanced exactly as tokens are accepted. Nothing
else can move it: a preempted request (recompute or swap) is forgotten and comes back whole, and a fresh matcher
consumes its output tokens; an interrupted or in-flight step that is undone never appended its token here.

`start` runs in a background thread while the forward pass runs (llguidance's mask call and torch release the
GIL): it advances the matchers, fills the batch's bitmask in parallel and unpacks it; `allowed` waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from proto.structured import grammar_of
from proto.wire import StructuredOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Matcher:
    matcher: llguidance.LLMatcher
    ends: frozenset[int]  # the tokens that end this request: where the grammar may end, they are allowed
    consumed: int = 0  # output tokens consumed


@dataclass(frozen=True, slots=True)
class GrammarRow:
    """One constrained request of a step: its output so far and what ends it."""

    handle: int  # the request's id on the wire
    structured: StructuredOutput
    output_token_ids: list[int]
    ends: frozenset[int]


class GrammarMasks:
    def __init__(self, tokenizer_file: Path, vocab_size: int) -> None:
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (about half a second)
        self._matchers: dict[int, _Matcher] = {}  # by request handle
        self._parallel = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pending: Future[torch.Tensor] | None = None

    def start(self, rows: Sequence[GrammarRow]) -> None:
        """Begin this step's masks for `rows` (all constrained: the masks come back in their order)."""
        self.wait()
        self._pending = self._thread.submit(self._masks, list(rows)) if rows else None

    def allowed(self, device: torch.device) -> torch.Tensor:
        """The started step's masks: bool [rows, vocab], True where the grammar allows the token."""
        if self._pending is None:
            raise RuntimeError("no masks were started for this step")
        allowed, self._pending = self._pending.result(), None
        return allowed.to(device, non_blocking=True)

    def wait(self) -> None:
        """Let a step's masks finish (a step interrupted before it sampled leaves them running)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def forget(self, handle: int) -> None:
        self.wait()
        self._matchers.pop(handle, None)

    def _masks(self, rows: list[GrammarRow]) -> torch.Tensor:
        tokenizer = self._llg_tokenizer()
        matchers = [self._advance(row, tokenizer) for row in rows]
        words = (self.vocab_size + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._parallel, [(m, i) for i, m in enumerate(matchers)], bitmask)
        bits = torch.from_numpy(bitmask).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)
        allowed = (bits & 1).bool().reshape(len(rows), words * 32)[:, : self.vocab_size]
        self._end_with_own_tokens(allowed, rows, tokenizer.eos_token)
        return allowed

    def _advance(self, row: GrammarRow, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        state = self._matchers.get(row.handle)
        if state is None:
            # log_level 0: no warnings on stderr per request (a reasoning grammar's stop string warns on each);
            # a matcher's errors are still read from it
            matcher = llguidance.LLMatcher(tokenizer, grammar_of(row.structured), log_level=0)
            state = _Matcher(matcher, row.ends)
            self._matchers[row.handle] = state
        for token in row.output_token_ids[state.consumed :]:
            if not state.matcher.is_stopped():  # a stopped matcher takes only EOS: its request is ending
                if token in state.ends and state.matcher.validate_tokens([token]) == 0:
                    token = tokenizer.eos_token  # one of the request's own end tokens ended it
                if not state.matcher.consume_token(token):
                    logger.warning(
                        "request %d: the grammar refused token %d: %s", row.handle, token, state.matcher.get_error()
                    )
        state.consumed = len(row.output_token_ids)
        return state.matcher

    def _end_with_own_tokens(self, allowed: torch.Tensor, rows: list[GrammarRow], eos: int) -> None:
        """Where a grammar may end (it allows the tokenizer's EOS), it allows the request's own end tokens instead:
        exactly the tokens the scheduler stops on. A request that ignores eos and has none keeps EOS."""
        can_end = allowed[:, eos].clone()
        ending = [(i, t) for i, row in enumerate(rows) if row.ends for t in row.ends]
        if ending:
            owners = torch.tensor([i for i, _ in ending])
            allowed[[i for i, row in enumerate(rows) if row.ends], eos] = False
            allowed[owners, torch.tensor([t for _, t in ending])] |= can_end[owners]

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(str(self.tokenizer_file), n_vocab=self.vocab_size)
        return self._tokenizer
