"""What vllm-bench sends: prompts with their output lengths (random lengths, a fixed-prefix mix, or a JSONL file),
and when (open-loop arrival times: Poisson, or gamma for burstier traffic)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler_node.text.tokenizer import ModelTokenizer
from settings.bench import LENGTH_DISTRIBUTIONS


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt: token ids (random datasets: exact lengths on every backend), text, or chat messages."""

    output_len: int
    prompt_ids: list[int] | None = None
    text: str = ""  # the prompt as text (decoded ids for random datasets)
    messages: list[dict[str, str]] | None = None
    prompt_len: int = 0  # 0: unknown here (the server's usage tells)


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution around `mean`: fixed, uniform in mean x [1 - spread, 1 + spread], or lognormal with
    sigma `spread` (its mean kept at `mean`); always at least 1."""

    mean: int
    dist: str = "uniform"
    spread: float = 0.0

    def __post_init__(self) -> None:
        limit = 1.0 if self.dist == "uniform" else 10.0
        if self.mean < 1 or self.dist not in LENGTH_DISTRIBUTIONS or not 0 <= self.spread < limit:
            raise ValueError(
                f"lengths: mean >= 1, dist one of {LENGTH_DISTRIBUTIONS}, spread in [0, {limit:g}); got {self}"
            )

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed" or self.spread == 0:
            return self.mean
        if self.dist == "uniform":
            return max(1, rng.randint(round(self.mean * (1 - self.spread)), round(self.mean * (1 + self.spread))))
        mu = math.log(self.mean) - self.spread**2 / 2
        return max(1, round(rng.lognormvariate(mu, self.spread)))


@dataclass
class RandomTokens:
    """Random ids from a tokenizer's ordinary vocabulary (no special or added tokens)."""

    tokenizer: ModelTokenizer
    rng: random.Random
    _ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        added = set(self.tokenizer.tokenizer.get_added_tokens_decoder())
        self._ids = [i for i in range(self.tokenizer.vocab_size) if i not in added]

    def ids(self, n: int) -> list[int]:
        return self.rng.choices(self._ids, k=n)

    def request(self, ids: list[int], output_len: int) -> BenchRequest:
        return BenchRequest(output_len, ids, self.tokenizer.decode(ids), prompt_len=len(ids))


def random_requests(
    tokenizer: ModelTokenizer, n: int, inputs: Lengths, outputs: Lengths, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    tokens = RandomTokens(tokenizer, rng)
    return [tokens.request(tokens.ids(inputs.sample(rng)), outputs.sample(rng)) for _ in range(n)]


def prefix_requests(
    tokenizer: ModelTokenizer, n: int, prefix_len: int, num_prefixes: int, inputs: Lengths, outputs: Lengths, seed: int
) -> list[BenchRequest]:
    """Each prompt is one of `num_prefixes` shared prefixes of `prefix_len` tokens (round robin), then a random
    suffix: what prefix caching is for (system prompts, few-shot examples)."""
    if prefix_len < 1 or num_prefixes < 1:
        raise ValueError(f"--prefix-len and --num-prefixes must be >= 1, got {prefix_len}, {num_prefixes}")
    rng = random.Random(seed)
    tokens = RandomTokens(tokenizer, rng)
    prefixes = [tokens.ids(prefix_len) for _ in range(num_prefixes)]
    return [tokens.request(prefixes[i % num_prefixes] + tokens.ids(inputs.sample(rng)), outputs.sample(rng))
            for i in range(n)]  # fmt: skip


def jsonl_requests(path: Path, n: int, outputs: Lengths, seed: int) -> list[BenchRequest]:
    """Lines of {"prompt": "..."} or {"messages": [...]}, each with an optional "max_tokens"; the first `n` (the
    file repeats when shorter)."""
    rng = random.Random(seed)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    requests = []
    for number, line in enumerate(lines, 1):
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(row, dict) or not (
            isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)
        ):
            raise ValueError(f'{path}:{number}: expected an object with "prompt" (a string) or "messages" (a list)')
        output_len = row.get("max_tokens") or outputs.sample(rng)
        requests.append(BenchRequest(int(output_len), text=row.get("prompt", ""), messages=row.get("messages")))
    return [requests[i % len(requests)] for i in range(n)]


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: gaps drawn from a gamma distribution with mean
    1 / rate and shape `burstiness` (1: Poisson arrivals; below 1 burstier, above 1 more even); all at 0 when
    the rate is infinite."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    at, times = 0.0, []
    for _ in range(n):
        times.append(at)
        at += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times
