"""The decode CUDA-graph path's padding, checked on CPU: the same static, padded buffers a captured graph
replays (batch padded to the nearest size with slot -1 tokens, block tables padded to a fixed width), run
eagerly through the Triton kernels in the interpreter, must give the tokens the plain path gives."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.support.engine import generate, load_runner  # noqa: E402
from tests.support.models import assert_teacher_forced, load_hf  # noqa: E402
from worker_node.attention import AttentionMetadata  # noqa: E402
from worker_node.cuda_graphs import DecodeGraphs, parse_sizes  # noqa: E402

pytestmark = pytest.mark.model

LENGTHS = [3, 18, 9]
MAX_TOKENS = [5, 4, 6]


def test_padded_decode_buffers_give_the_same_tokens(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]
    plain, _ = generate(tiny_llama_dir, load_runner(tiny_llama_dir, 12, 16, "triton"), prompts, MAX_TOKENS)

    runner = load_runner(tiny_llama_dir, 12, 16, "triton")
    graphs = DecodeGraphs(runner.model, runner.kv_cache, [2, 4], 6, 64, runner.dtype, runner.device, False, False)
    used: list[int] = []
    run = graphs.run

    def run_and_note(
        ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        used.append(ids.shape[0])
        return run(ids, positions, meta, hidden)

    monkeypatch.setattr(graphs, "run", run_and_note)
    runner.graphs = graphs
    padded, _ = generate(tiny_llama_dir, runner, prompts, MAX_TOKENS)

    assert 3 in used and 1 in used, used  # batches of 3 (padded to 4) and of 1 (padded to 2) took the path
    hf = load_hf(tiny_llama_dir)
    for prompt, a, b in zip(prompts, plain, padded):
        assert b == a
        assert_teacher_forced(hf, prompt, b)


def test_parse_sizes() -> None:
    assert parse_sizes("8,1, 2,2") == [1, 2, 8] and parse_sizes("") == []
    with pytest.raises(ValueError):
        parse_sizes("0,4")
