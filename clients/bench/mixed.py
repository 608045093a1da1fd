"""A mixed load of streaming gRPC requests whose every outcome is kept (the chaos tests and scripts/soak.py):
greedy and seeded, n > 1, shared system prompts, some cancelled by their clients mid-way."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc

VOCAB = 49152


@dataclass
class Outcome:
    """One request as its client saw it."""

    prompt: list[int]
    request: pb.GenerateRequest
    cancel_after: int = 0  # the client cancels after this many tokens (0: never)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # per sequence index
    finish: dict[int, str] = field(default_factory=dict)
    code: str = ""  # "" when the stream ended by itself; else the gRPC status name
    details: str = ""
    seconds: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.request.sampling.temperature == 0.0

    @property
    def n(self) -> int:
        return self.request.sampling.n or 1


def mixed_requests(
    rng: random.Random, count: int, max_tokens: tuple[int, int], cancel_share: float = 0.15
) -> list[Outcome]:
    """Greedy and seeded requests, some with n > 1, some sharing a system prompt, some cancelled mid-way."""
    systems = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    out = []
    for i in range(count):
        prompt = rng.choice(systems) if rng.random() < 0.5 else []
        prompt = prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        greedy = rng.random() < 0.6
        n = rng.choice([1, 1, 1, 2, 3])
        sampling = pb.SamplingParams(
            max_tokens=rng.randint(*max_tokens),
            temperature=0.0 if greedy else 0.8,
            top_p=1.0 if greedy else 0.95,
            ignore_eos=True,
            n=n,
        )
        if not greedy:
            sampling.seed = 1000 + i
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling, request_id=f"c{i}")
        cancel = rng.randint(2, 8) if rng.random() < cancel_share else 0
        out.append(Outcome(prompt, request, cancel))
    return out


def stream(stub: pb_grpc.GenerationStub, outcome: Outcome, bound: float, delay: float = 0.0) -> None:
    """Run one request to its end (after `delay` seconds); a client deadline (`bound` seconds) marks a hang."""
    time.sleep(delay)
    start = time.monotonic()
    call = stub.Generate(outcome.request, timeout=bound)
    try:
        for delta in call:
            outcome.tokens.setdefault(delta.index, []).extend(delta.token_ids)
            if delta.finish_reason:
                outcome.finish[delta.index] = delta.finish_reason
            if outcome.cancel_after and sum(map(len, outcome.tokens.values())) >= outcome.cancel_after:
                call.cancel()
    except grpc.RpcError as exc:
        outcome.code, outcome.details = exc.code().name, exc.details() or ""
    outcome.seconds = time.monotonic() - start


class Load:
    """Every request on its own thread, started at once (or spread over `spread` seconds)."""

    def __init__(
        self, stub: pb_grpc.GenerationStub, outcomes: list[Outcome], bound: float, spread: float = 0.0
    ) -> None:
        self.outcomes = outcomes
        self.threads = []
        for i, o in enumerate(outcomes):
            delay = spread * i / max(1, len(outcomes))
            t = threading.Thread(target=stream, args=(stub, o, bound, delay), daemon=True)
            t.start()
            self.threads.append(t)

    def tokens_so_far(self) -> int:
        return sum(len(t) for o in self.outcomes for t in o.tokens.values())

    def progress(self, tokens: int) -> Callable[[], bool]:
        """A check that `tokens` more have arrived since now."""
        start = self.tokens_so_far()
        return lambda: self.tokens_so_far() >= start + tokens

    def join(self, timeout: float) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        return self.outcomes
