"""SamplingParams: how to sample one request's completions (vLLM's names and defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_node.api.validation import SamplingFields, StructuredFields


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output text (vLLM's StructuredOutputsParams); set exactly one field."""

    json: str | Mapping[str, Any] | None = None  # a JSON schema (text or a dict)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these
    json_object: bool = False  # any JSON object

    def fields(self) -> StructuredFields:
        choice = None if self.choice is None else list(self.choice)
        return StructuredFields(json=self.json, regex=self.regex, choice=choice, json_object=self.json_object)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0: off)
    seed: int | None = None  # the same seed gives the same tokens, in any batch
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # eos and stop_token_ids cannot end a completion before this many tokens
    stop: list[str] | str | None = None  # strings that end a completion (not included in its text)
    stop_token_ids: list[int] | None = None  # tokens that end a completion (in its token_ids, not its text)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output so far
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times each token's count in the output
    presence_penalty: float = 0.0  # in [-2, 2]: minus this for each token already in the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    bad_words: list[str] | None = None  # words never generated
    logprobs: int | None = None  # also return this many top alternatives per token (0: only the sampled one's)
    prompt_logprobs: int | None = None  # each prompt token's logprob, plus this many top alternatives
    structured_outputs: StructuredOutputsParams | None = None
    kv_precision: str = "auto"  # auto, full or compact: the format of the request's KV blocks (LLM kv_compact_*)

    def fields(self) -> SamplingFields:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingFields(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            n=self.n,
            logprobs=self.logprobs,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias=dict(self.logit_bias or {}),
            bad_words=list(self.bad_words or []),
            prompt_logprobs=self.prompt_logprobs,
            structured=None if self.structured_outputs is None else self.structured_outputs.fields(),
        )
