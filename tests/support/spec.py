"""A proposer for tests: it proposes what a reference run generated, each token wrong with some probability, so
that a speculating engine sees proposals accepted in full, in part and not at all, on any model (a random tiny
model never repeats itself, so n-gram proposals would all miss)."""

from __future__ import annotations

import random

from scheduler_node.core.request import Request
from scheduler_node.core.speculative import SpecState


class ScriptedProposer:
    on_worker = False

    def __init__(
        self, reference: dict[tuple[int, ...], list[int]], wrong: float, seed: int = 0, always_k: bool = False
    ) -> None:
        self.reference = reference  # prompt -> the output a run without speculation gave
        self.wrong = wrong
        self.always_k = always_k  # propose k tokens each time (else 1 to k at random)
        self.rng = random.Random(seed)

    def propose(self, req: Request, state: SpecState, k: int) -> list[int]:
        ref = self.reference.get(tuple(req.prompt_token_ids), [])
        done = len(req.output_token_ids)
        proposal = ref[done : done + (k if self.always_k else self.rng.randint(1, k))]
        return [self.rng.randrange(3, 1000) if self.rng.random() < self.wrong else t for t in proposal]
