"""--batch-invariant (kernels/cpu_gemm.py's `linear`, `invariant`): a seeded stream's tokens and logprobs are the
same bits alone as beside 1, 3 or 17 other requests, in float32 and bf16, through the whole engine. Without it,
torch's CPU matmul changes its algorithm with the batch's row count, the logits move by ~1e-6, and a seeded draw
near a boundary of its distribution flips (a migrated stream parting from its undisturbed run, issue 31)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from proto.wire import SamplingOptions
from tests.support.engine import EngineRun, Submitted, load_runner

pytestmark = pytest.mark.model

BLOCK = 16
TOKENS = 24
SEEDED = SamplingOptions(temperature=0.8, seed=5, logprobs=3)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(rng.randrange(6, 30))]


def bits(sub: Submitted) -> tuple[list[int], list[object]]:
    """The stream's tokens and every logprob it reported (its token's and the top 3), as exact floats."""
    return sub.output, [(lp.logprob, lp.top) for lp in sub.completions[0].logprobs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_seeded_stream_is_the_same_beside_any_batch(tiny_llama_dir: Path, dtype: str) -> None:
    runner = load_runner(tiny_llama_dir, 80, BLOCK, dtype=dtype, batch_invariant=True)
    # No prefix cache: a second run of the same prompt would compute only its last token, another path.
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, enable_prefix_caching=False) as run:
        alone = run.add(prompt(0), TOKENS, sampling=SEEDED)
        run.run()
        for company in (1, 3, 17):
            target = run.add(prompt(0), TOKENS, sampling=SEEDED)
            for i in range(1, company + 1):  # arriving with it and outliving it: every step of it is shared
                run.add(prompt(i), TOKENS + 4, sampling=SamplingOptions(temperature=1.0, seed=100 + i))
            run.run()
            assert bits(target) == bits(alone), f"beside {company} others"
