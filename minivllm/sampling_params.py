"""SamplingParams: how to sample one request's completions (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_node.api.validation import SamplingFields


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None  # the same seed gives the same tokens, in any batch
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None  # strings that end a completion (not included in its text)
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top alternatives per token (0: only the sampled one's)

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
        )
