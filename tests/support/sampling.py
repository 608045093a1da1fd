"""A request as the sampler reads it (worker_node/sampler.py SamplingRequest), for sampler tests."""

from __future__ import annotations

from dataclasses import dataclass

from proto.wire import SamplingOptions


@dataclass
class SamplerRow:
    handle: int
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling: SamplingOptions
