"""Quantized weights give HF's greedy tokens (teacher-forced, fp32 activations, 1e-3) when HF runs on the weights
they stand for (the dequantized ones), alone and over two tensor-parallel ranks: the formats' numbers, their
TP slicing (scales following their channels) and a quantized LM head, checked where a mistake shows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from minivllm.tiny_models import build_tiny_model
from tests.support.awq_checkpoint import write_awq_checkpoint
from tests.support.engine import load_runner
from tests.support.inprocess_tp import TensorParallelRanks
from tests.support.models import assert_same_logprobs, assert_teacher_forced, load_hf, teacher_forced_gaps
from tests.support.quant import hf_on_dequantized
from tests.worker_node.models.test_models import BLOCK, MAX_TOKENS, NUM_BLOCKS, generate, prompts
from worker_node.models.quant_linear import QuantLinear
from worker_node.models.quantize import make_method

pytestmark = pytest.mark.model

AwqModel = tuple[Path, Path, dict[str, torch.Tensor]]  # the full-precision source, its AWQ checkpoint, W' by name


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_matches_hf_on_dequantized_weights(fmt: str, tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir("qwen3")  # q/k norms and its own head_dim: every projection's shape differs
    runner = load_runner(folder, NUM_BLOCKS, BLOCK, quantization=fmt)
    alone = generate(folder, [runner])
    tp2 = TensorParallelRanks(folder, NUM_BLOCKS, BLOCK, tp=2, quantization=fmt)
    try:
        split = generate(folder, tp2.runners, tp2.transport())
    finally:
        tp2.close()
    hf = hf_on_dequantized(folder, make_method(fmt, runner.device))
    for i, (prompt, out) in enumerate(zip(prompts(), alone)):
        assert len(out) == MAX_TOKENS[i]
        assert_teacher_forced(hf, prompt, out)
        assert_teacher_forced(hf, prompt, split[i])
    assert_same_logprobs(hf, runner, prompts()[-1] + alone[-1])
    # and the quantization is real: the full-precision model scores the same tokens differently
    full = load_hf(folder)
    assert max(float(teacher_forced_gaps(full, p, o).max()) for p, o in zip(prompts(), alone)) > 1e-4


@pytest.fixture(scope="module")
def awq_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> AwqModel:
    """A tiny Llama wide enough for groups of 128 on every projection, on both TP ranks, written as AutoAWQ does."""
    source = build_tiny_model(
        "llama", tmp_path_factory.mktemp("awq-source"), smollm2_dir, hidden_size=256, intermediate_size=256
    )
    folder = tmp_path_factory.mktemp("awq") / "model"
    return source, folder, write_awq_checkpoint(source, folder, group=128)


@torch.inference_mode()
def test_awq_checkpoint_matches_hf_on_its_dequantized_weights(awq_model: AwqModel) -> None:
    source, folder, dequantized = awq_model
    runner = load_runner(folder, NUM_BLOCKS, BLOCK)  # auto: the checkpoint's quantization_config says awq
    layer = next(m for m in runner.model.modules() if isinstance(m, QuantLinear))
    assert isinstance(layer, QuantLinear) and layer.method.name == "awq"
    alone = generate(folder, [runner])
    tp2 = TensorParallelRanks(folder, NUM_BLOCKS, BLOCK, tp=2, quantization="awq")
    try:
        split = generate(folder, tp2.runners, tp2.transport())
    finally:
        tp2.close()
    hf = load_hf(source)  # the full-precision model, its projections replaced by what the checkpoint stands for
    for name, param in hf.named_parameters():
        if name in dequantized:
            param.copy_(dequantized[name])
    for i, (prompt, out) in enumerate(zip(prompts(), alone)):
        assert len(out) == MAX_TOKENS[i]
        assert_teacher_forced(hf, prompt, out)
        assert_teacher_forced(hf, prompt, split[i])
    assert_same_logprobs(hf, runner, prompts()[-1] + alone[-1])
