"""What `LLM.generate` returns: one RequestOutput per prompt, in input order, with its n completions; what
`LLM.embed` returns: one EmbeddingRequestOutput per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.wire import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # stop (eos or a stop string), length
    logprobs: list[TokenLogprobs] | None = None  # per token, when SamplingParams.logprobs was set

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing comes before it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt: `outputs.embedding`, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
