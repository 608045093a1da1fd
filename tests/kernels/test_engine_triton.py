"""The whole engine (scheduler + model runner over the msgpack wire) on the Triton attention backend.

The kernels run in Triton's interpreter (TRITON_INTERPRET=1, conftest), so the batch is tiny: three prompts
whose prefills are chunked by a 16-token budget, each later chunk attending to its paged prefix across a
16-token block boundary, in steps that also carry other requests' decodes (and split-KV decode segments).
The tiny Gemma 2 brings a sliding window shorter than the prompts and soft-capped attention scores.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kernels.interface import AttentionBackend  # noqa: E402
from tests.support.engine import generate, load_runner  # noqa: E402
from tests.support.models import assert_teacher_forced, load_hf  # noqa: E402
from worker_node.models.layers import Attention  # noqa: E402

pytestmark = pytest.mark.model

BLOCK = 16
NUM_BLOCKS = 12  # the batch peaks at 7 blocks: no preemption, this test is about the kernels
BUDGET = 16  # max_num_batched_tokens: forces chunked prefill mixed with decodes
LENGTHS = [5, 17, 35]  # inside one block, just past it, across two boundaries
MAX_TOKENS = [6, 4, 5]


@dataclasses.dataclass
class _Seen:
    """What reached the attention backend: the shapes that make the test mean something."""

    prefill_over_prefix: int = 0  # prefill calls where some chunk attends to an earlier cached chunk
    prefix_across_block: int = 0  # ... whose chunk starts in one block and ends in the next
    mixed_steps: int = 0  # forward passes with both decodes and prefill chunks
    decode_calls: int = 0


def _spy(backend: AttentionBackend, seen: _Seen) -> AttentionBackend:
    def decode(q: torch.Tensor, *args: object, **options: object) -> torch.Tensor:
        seen.decode_calls += 1
        return backend.decode_attention(q, *args, **options)  # type: ignore[arg-type]

    def prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        **options: Any,
    ) -> torch.Tensor:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        prefix = seq_lens.long() - q_lens
        if bool((prefix > 0).any()):
            seen.prefill_over_prefix += 1
        if bool(((prefix > 0) & (prefix // BLOCK != (seq_lens.long() - 1) // BLOCK)).any()):
            seen.prefix_across_block += 1
        return backend.prefill_attention(
            q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, **options
        )

    return dataclasses.replace(backend, decode_attention=decode, prefill_attention=prefill)


def _run(folder: Path, backend: str, prompts: list[list[int]]) -> tuple[list[list[int]], _Seen]:
    runner = load_runner(folder, NUM_BLOCKS, BLOCK, backend=backend)
    seen = _Seen()
    first = runner.model.layers[0].self_attn
    assert isinstance(first, Attention), "every family keeps its layer's Attention in self_attn"
    assert first.backend.name == backend
    spy = _spy(first.backend, seen)
    first.backend = spy  # one layer is enough to see the shapes; the others run unwatched

    execute = runner.execute

    def execute_and_note(plan):  # type: ignore[no-untyped-def]
        counts = list(plan.num_scheduled_tokens.values())
        if 1 in counts and any(n > 1 for n in counts):
            seen.mixed_steps += 1
        return execute(plan)

    runner.execute = execute_and_note  # type: ignore[method-assign]
    outputs, scheduler = generate(folder, runner, prompts, MAX_TOKENS, max_num_batched_tokens=BUDGET)
    assert scheduler.num_preemptions == 0
    assert scheduler.blocks.num_free == NUM_BLOCKS
    return outputs, seen


@pytest.mark.parametrize("kind", ["llama", "gemma2"])  # gemma2: a sliding window (layer 0) and soft-caps
def test_engine_on_triton_matches_torch_and_hf(kind: str, request: pytest.FixtureRequest) -> None:
    folder = (
        request.getfixturevalue("tiny_llama_dir")
        if kind == "llama"
        else request.getfixturevalue("tiny_model_dir")(kind)
    )
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]

    triton_out, seen = _run(folder, "triton", prompts)
    assert seen.prefill_over_prefix > 0, "no prefill chunk attended to a cached prefix"
    assert seen.prefix_across_block > 0, "no prefill chunk crossed a block boundary over its prefix"
    assert seen.mixed_steps > 0, "no step mixed decodes with prefill chunks"
    assert seen.decode_calls > 0
    assert [len(t) for t in triton_out] == MAX_TOKENS

    torch_out, _ = _run(folder, "torch", prompts)
    assert triton_out == torch_out

    hf = load_hf(folder)
    for prompt, output in zip(prompts, triton_out):
        assert_teacher_forced(hf, prompt, output)
