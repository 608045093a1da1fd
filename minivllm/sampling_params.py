"""SamplingParams: how to sample one request's completions (vLLM's names and defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_node.api.sampling import SamplingFields, StructuredFields

_DEFAULT = SamplingFields()  # the servers' defaults, which are vLLM's (but for max_tokens)


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output text (vLLM's StructuredOutputsParams); set exactly one field."""

    json: str | Mapping[str, Any] | None = None  # a JSON schema (text or a dict)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these
    json_object: bool = False  # any JSON object

    def fields(self) -> StructuredFields:
        return StructuredFields.gather(lambda name: getattr(self, name))


@dataclass(slots=True)
class SamplingParams:
    """vLLM's names; each field is checked as the servers check it (api/validation.py)."""

    n: int = _DEFAULT.n  # completions per prompt
    temperature: float = _DEFAULT.temperature  # 0: greedy
    top_p: float = _DEFAULT.top_p
    top_k: int = _DEFAULT.top_k  # -1 or 0: off
    min_p: float = _DEFAULT.min_p  # drop tokens less likely than min_p x the most likely one (0: off)
    seed: int | None = _DEFAULT.seed  # the same seed gives the same tokens, in any batch
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = _DEFAULT.min_tokens  # eos and stop_token_ids cannot end a completion before this many tokens
    stop: list[str] | str | None = None  # strings that end a completion (not included in its text)
    stop_token_ids: list[int] | None = None  # tokens that end a completion (in its token_ids, not its text)
    ignore_eos: bool = _DEFAULT.ignore_eos
    # > 1 discourages tokens of the prompt and the output so far
    repetition_penalty: float = _DEFAULT.repetition_penalty
    # in [-2, 2]: minus this times each token's count in the output
    frequency_penalty: float = _DEFAULT.frequency_penalty
    presence_penalty: float = _DEFAULT.presence_penalty  # in [-2, 2]: minus this for each token already in the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    bad_words: list[str] | None = None  # words never generated
    # also return this many top alternatives per token (0: only the sampled one's)
    logprobs: int | None = _DEFAULT.logprobs
    # each prompt token's logprob, plus this many top alternatives
    prompt_logprobs: int | None = _DEFAULT.prompt_logprobs
    structured_outputs: StructuredOutputsParams | None = None
    kv_precision: str = "auto"  # auto, full or compact: the format of the request's KV blocks (LLM kv_compact_*)
    speculate: bool = True  # False: no speculative decoding for this request (LLM speculative_config)

    def fields(self) -> SamplingFields:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        structured = None if self.structured_outputs is None else self.structured_outputs.fields()
        return SamplingFields.gather(lambda name: getattr(self, name), stop=stop, structured=structured)
