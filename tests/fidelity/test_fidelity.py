"""Greedy output is HF transformers' argmax at every position, for every request of a mixed batch."""

from __future__ import annotations

import random

import pytest

from tests.support.engine import EngineRun, load_runner
from tests.support.models import assert_teacher_forced, load_hf

pytestmark = pytest.mark.model

BLOCK = 16


def mixed_prompts(seed: int, vocab: int = 49152) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 15, 16, 17, 33, 48, 70]  # inside, at and across block boundaries
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    max_tokens = [40, 7, 19, 33, 1, 25, 12, 30]
    return prompts, max_tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_matches_hf_under_chunking_and_preemption(kind: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(f"tiny_{kind}_dir")
    prompts, max_tokens = mixed_prompts(7)
    num_blocks = 14  # the batch needs ~20 blocks at its peak: forces recompute preemption
    runner = load_runner(folder, num_blocks, BLOCK)
    with EngineRun(runner, tokenizer_dir=folder, max_num_batched_tokens=24) as run:  # 24: chunked prefill
        requests = [run.add(p, m) for p, m in zip(prompts, max_tokens)]
        run.run()
        assert run.scheduler.num_preemptions > 0, "the test lost its point: no preemption happened"
        assert run.scheduler.blocks.num_free == num_blocks
    hf = load_hf(folder)
    for req, prompt, m in zip(requests, prompts, max_tokens):
        assert len(req.output) == m
        assert_teacher_forced(hf, prompt, req.output)


def test_smollm2_greedy_matches_hf(smollm2_dir) -> None:  # type: ignore[no-untyped-def]
    from scheduler_node.text.tokenizer import ModelTokenizer

    tok = ModelTokenizer(smollm2_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived",
    ]
    prompts = [tok.encode(t) for t in texts]
    with EngineRun(load_runner(smollm2_dir, 64, BLOCK), tokenizer_dir=smollm2_dir, max_num_batched_tokens=16) as run:
        requests = [run.add(p, 24) for p in prompts]
        run.run()
    hf = load_hf(smollm2_dir)
    for req, prompt in zip(requests, prompts):
        assert_teacher_forced(hf, prompt, req.output)
