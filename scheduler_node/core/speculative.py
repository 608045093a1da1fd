"""Speculative decoding on the scheduler's side: the per-step policy and the counters (its setting,
`SpeculativeConfig`, is settings/speculative.py's).

A speculating request schedules 1 + k tokens (its last known token and k proposed ones, `draft_token_ids` in its
plan entry); the worker scores them in one forward pass and returns the longest prefix of proposals its own
sampler agrees with, plus the one token it sampled after them (worker_node/spec_decode.py). The scheduler then
rolls its computed tokens back by the rejected proposals (`Scheduler.update`). Proposals are made here, where every
request's tokens are known (core/proposers.py).

When to speculate (the policy): only while at most `disable_by_batch_size` requests run (a bigger batch fills the
step already: verifying k more tokens per request would cost more than it saves), only for requests whose options
the worker can verify exactly (no logits processors, logprobs or grammar; see `eligible`), and per request by its
measured acceptance: one whose proposals keep being rejected pauses for a while.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.wire import SamplingOptions

PAUSE_STEPS = 16  # a request whose proposals are mostly rejected proposes nothing for this many of its steps
MIN_ACCEPTANCE = 0.2  # ... where "mostly" is an acceptance rate (accepted / proposed, a moving average) below this


def eligible(sampling: SamplingOptions) -> bool:
    """Whether the worker verifies this request's proposals exactly: it samples every position of a speculated
    step as a normal step would, which needs the request's logits to depend on nothing but the model (no
    penalties, bias, bans or grammar, whose state would follow the proposals) and no logprobs to return."""
    o = sampling
    return not (
        o.logit_bias
        or o.bad_words
        or o.structured is not None
        or o.min_tokens
        or o.logprobs is not None
        or o.prompt_logprobs is not None
        or o.repetition_penalty != 1.0
        or o.frequency_penalty != 0.0
        or o.presence_penalty != 0.0
    )


@dataclass(slots=True)
class SpecCounters:
    """vLLM's speculative decoding counters (Prometheus `vllm:spec_decode_*`, GetStats, vllm-monitor)."""

    num_drafts: int = 0  # speculated steps of a request
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # of which accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at position i of a draft

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per speculated step: the accepted ones plus the one sampled after them (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class SpecState:
    """A request's speculation state on the scheduler."""

    rate: float = 1.0  # accepted / proposed, a moving average (optimistic at first)
    pause: int = 0  # steps left without proposals
    # The proposer's own memory of the request (the n-gram index), kept here so that it ends with the request.
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    first: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its first occurrence
    indexed: int = 0  # tokens the index has seen
    # A draft model's proposals (from the worker, StepResult.drafts) and the request's length they follow.
    drafted: list[int] = field(default_factory=list)
    drafted_at: int = -1

    def observe(self, proposed: int, accepted: int) -> None:
        self.rate = 0.7 * self.rate + 0.3 * accepted / proposed
        if self.rate < MIN_ACCEPTANCE:
            self.pause = PAUSE_STEPS
            self.rate = 0.5  # after the pause it gets another chance, not a certain one
