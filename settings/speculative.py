"""Speculative decoding's setting: `--speculative-config` / `LLM(speculative_config=...)`, with vLLM's key names.

The config is one setting whose value is a JSON object (a mapping in a config file or to `LLM`), checked whole
here; the scheduler's policy and counters are scheduler_node/core/speculative.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from proto.nesting import parse_nested

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DISABLE_BY_BATCH_SIZE = 8  # measured on CPU: scripts/bench_spec.py (docs/benchmarks.md)


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


def speculative_text(value: str | Mapping[str, Any]) -> str:
    """The setting's text form: the checked config as JSON ("" for none), so that a command line forwards it as
    given (vllm-serve) and a config file may write it as a mapping. ValueError names the bad key."""
    config = SpeculativeConfig.parse(value)
    return json.dumps(asdict(config)) if config is not None else ""
