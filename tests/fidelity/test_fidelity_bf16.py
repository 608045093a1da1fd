"""bf16 on CPU: every greedy token within 0.05 logprob of the argmax of HF's bf16 model on the same prefix.

float32 stays the reference at 1e-3 (tests/fidelity/test_fidelity.py); bf16 rounds weights, activations and the KV
cache,
so two implementations of the same bf16 model differ by rounding, and the tolerance is that of the brief.
"""

from __future__ import annotations

import pytest
import torch

from tests.fidelity.test_fidelity import BLOCK, mixed_prompts
from tests.support.engine import EngineRun, load_runner
from tests.support.models import assert_teacher_forced, load_hf
from worker_node.loading import pick_dtype

pytestmark = pytest.mark.model

BF16_TOL = 0.05


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_bf16_greedy_matches_hf_bf16_under_chunking_and_preemption(kind: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(f"tiny_{kind}_dir")
    prompts, max_tokens = mixed_prompts(11)
    num_blocks = 14
    runner = load_runner(folder, num_blocks, BLOCK, dtype="bfloat16")
    assert runner.kv_cache[0].k.dtype == torch.bfloat16
    with EngineRun(runner, tokenizer_dir=folder, max_num_batched_tokens=24) as run:
        requests = [run.add(p, m) for p, m in zip(prompts, max_tokens)]
        run.run()
        assert run.scheduler.num_preemptions > 0, "the test lost its point: no preemption happened"
    hf = load_hf(folder, torch.bfloat16)
    for req, prompt, m in zip(requests, prompts, max_tokens):
        assert len(req.output) == m
        assert_teacher_forced(hf, prompt, req.output, tol=BF16_TOL)


def test_smollm2_bf16_greedy_matches_hf_bf16(smollm2_dir) -> None:  # type: ignore[no-untyped-def]
    from scheduler_node.text.tokenizer import ModelTokenizer

    tok = ModelTokenizer(smollm2_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived",
        "List three colours:",
    ]
    prompts = [tok.encode(t) for t in texts]
    runner = load_runner(smollm2_dir, 64, BLOCK, dtype="bfloat16")
    with EngineRun(runner, tokenizer_dir=smollm2_dir, max_num_batched_tokens=16) as run:
        requests = [run.add(p, 32) for p in prompts]
        run.run()
    hf = load_hf(smollm2_dir, torch.bfloat16)
    for req, prompt in zip(requests, prompts):
        assert_teacher_forced(hf, prompt, req.output, tol=BF16_TOL)


@pytest.mark.parametrize(
    ("flags", "device", "want"),
    [
        ("flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni", "cpu", torch.bfloat16),
        ("flags\t\t: fpu sse avx2 amx_bf16 amx_tile", "cpu", torch.bfloat16),
        ("flags\t\t: fpu sse avx2 avx512f avx512bw", "cpu", torch.float32),
        ("Features\t: fp asimd", "cpu", torch.float32),
        ("flags\t\t: fpu sse avx2", "cuda", torch.bfloat16),
    ],
)
def test_auto_dtype_follows_the_cpu(
    flags: str, device: str, want: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernels import cpu_features

    monkeypatch.setattr(cpu_features, "cpu_flags_line", lambda: flags)
    assert pick_dtype("auto", torch.device(device)) == want
    assert pick_dtype("float32", torch.device(device)) == torch.float32
