"""The torch decode path works out which blocks each sequence holds once per step, in the step's metadata (the
backend's `plan_decode`), not once per layer and not in a module-level cache shared between threads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernels import torch_attention
from tests.support.engine import generate, load_runner
from tests.support.models import assert_teacher_forced, load_hf

pytestmark = pytest.mark.model


def test_one_decode_layout_per_step_shared_by_every_layer(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = torch_attention.decode_layout

    def counted(*args: Any) -> Any:
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch_attention, "decode_layout", counted)
    runner = load_runner(tiny_llama_dir, 32, backend="torch")
    assert len(runner.model.layers) > 1, "the test needs several layers to share the plan"
    prompt = [5, 9, 14, 2, 7, 11]
    (out,), _ = generate(tiny_llama_dir, runner, [prompt], [6])
    decode_steps = len(out) - 1  # the first token comes from the prefill
    assert len(calls) == decode_steps, f"{len(calls)} layouts for {decode_steps} decode steps"
    assert_teacher_forced(load_hf(tiny_llama_dir), prompt, out)
