"""Proposers: where a speculating request's k proposed tokens come from.

A proposer runs on the scheduler, which knows every request's tokens; its proposals travel in the plan
(`CachedRequest.draft_token_ids`). One interface, so that others (a suffix tree, EAGLE-style heads) can join:
`propose(req, k)` returns at most k tokens to follow the request's known ones. A proposer whose tokens the worker
makes (a draft model) says so with `on_worker`: the scheduler then asks the worker for them in the plan before
(`StepPlan.propose`) and keeps what comes back (`SpecState.drafted`).
"""

from __future__ import annotations

from typing import Protocol

from scheduler_node.core.request import Request
from scheduler_node.core.speculative import SpecState
from settings.speculative import SpeculativeConfig


class Proposer(Protocol):
    on_worker: bool  # its proposals are made by the worker after a step (StepPlan.propose, StepResult.drafts)

    def propose(self, req: Request, state: SpecState, k: int) -> list[int]:
        """At most `k` tokens to follow `req`'s tokens (prompt + output, all known); [] for none."""
        ...


class NgramProposer:
    """Prompt lookup: the longest suffix of the sequence (prompt_lookup_max down to prompt_lookup_min tokens) that
    occurred before in it proposes the tokens that followed its latest earlier occurrence.

    The latest occurrence is the likeliest to be copied on; when fewer than k tokens follow it (a match close to
    the end, as in a run of one repeated token), the first occurrence proposes instead. Each request keeps an index
    from each n-gram to where its first and latest occurrences end, brought up to date with the tokens added since
    the last step, so a proposal costs O(new tokens), not a scan of the sequence. The index lags one token behind
    the sequence: the suffix itself is never its own match."""

    on_worker = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, req: Request, state: SpecState, k: int) -> list[int]:
        tokens = req.prompt_token_ids + req.output_token_ids if req.output_token_ids else req.prompt_token_ids
        length = len(tokens)
        self._index(tokens, state, length - 1)
        index = state.index
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            key = tuple(tokens[length - n :])
            end = index.get(key)
            if end is not None:
                if end + k > length:
                    end = state.first[key]
                return tokens[end : end + k]
        return []

    def _index(self, tokens: list[int], state: SpecState, upto: int) -> None:
        """Enter the n-grams ending at positions state.indexed + 1 .. upto (exclusive ends) into the index."""
        index, first, lo, hi = state.index, state.first, self.min_n, self.max_n
        for end in range(max(state.indexed, lo), upto + 1):
            for n in range(lo, min(hi, end) + 1):
                key = tuple(tokens[end - n : end])
                index[key] = end
                first.setdefault(key, end)
        state.indexed = max(state.indexed, upto + 1)


class DraftModelProposer:
    """A draft model's tokens: the worker decodes them after a step that asked (worker_node/draft_model.py) and
    returns them with its result; they propose only while they still follow the request's tokens (a result
    applied since, a stop that cut the step, make them stale)."""

    on_worker = True

    def propose(self, req: Request, state: SpecState, k: int) -> list[int]:
        drafted, state.drafted = state.drafted, []
        return drafted[:k] if state.drafted_at == req.num_tokens else []


def make_proposer(config: SpeculativeConfig) -> Proposer:
    return DraftModelProposer() if config.method == "draft_model" else NgramProposer(config)
