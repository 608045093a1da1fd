"""Speculative decoding on the scheduler's side: the typed config, the per-step policy, the counters.

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

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from proto.nesting import parse_nested
from proto.wire import SamplingOptions

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DISABLE_BY_BATCH_SIZE = 8  # measured on CPU: scripts/bench_spec.py (docs/benchmarks.md)
PAUSE_STEPS = 16  # a request whose proposals are mostly rejected proposes nothing for this many of its steps
MIN_ACCEPTANCE = 0.2  # ... where "mostly" is an acceptance rate (accepted / proposed, a moving average) below this


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`--speculative-config` / `LLM(speculative_config=...)`, with vLLM's key names."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens proposed per step
    prompt_lookup_max: int = 4  # the longest suffix of the sequence matched against its earlier tokens
    prompt_lookup_min: int = 1  # the shortest
    disable_by_batch_size: int = DISABLE_BY_BATCH_SIZE  # no speculation while more requests than this run
    model: str = ""  # method draft_model: the draft's folder (the target's tokenizer and vocabulary)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: must be one of {SPEC_METHODS}, got {self.method!r}")
        if type(self.model) is not str:
            raise ValueError(f"speculative_config.model: must be a folder path, got {self.model!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: required with method draft_model (the draft's folder)")
        if self.method != "draft_model" and self.model:
            raise ValueError(f"speculative_config.model: only with method draft_model, not {self.method}")
        for name, low, high in (
            ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
            ("disable_by_batch_size", 1, 1 << 20),
        ):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"speculative_config.{name}: must be an integer in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON object's text (the flag), a mapping (`LLM`, a config file) or a config; None stays None.
        ValueError names the key that is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = parse_nested(json.loads, value, "speculative_config")
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not a JSON object: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config: must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError("speculative_config.method: required (one of " + ", ".join(SPEC_METHODS) + ")")
        values = dict(value)
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            default = next(f.default for f in fields(cls) if f.name == "prompt_lookup_min")
            values["prompt_lookup_min"] = min(default, values["prompt_lookup_max"])
        return cls(**values)


def speculative_config_flag(value: str | Mapping[str, Any]) -> str:
    """`--speculative-config`'s type: the checked config as JSON text ("" for none), so that it is forwarded as
    given (vllm-serve) and a config file may write it as a mapping. ArgumentTypeError names the bad key."""
    import argparse

    try:
        config = SpeculativeConfig.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return json.dumps(asdict(config)) if config is not None else ""


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
