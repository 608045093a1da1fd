"""HF's model on the weights a quantized model of ours stands for: each weight we quantize replaced by its
dequantized value (the same numbers our layers multiply by), so greedy tokens and log-probabilities compare
exactly as they do for a full-precision model."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import load_hf
from worker_node.models.quant_linear import QuantLinear, QuantMethod

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.inference_mode()
def hf_on_dequantized(folder: Path, method: QuantMethod):  # type: ignore[no-untyped-def]
    """HF's float32 model of `folder` whose projections hold the method's dequantized weights (the LM head and
    embedding stay as stored, as ours do). Per-output-channel formats quantize a fused q/k/v row by row, so quantizing
    q, k and v apart gives the same numbers."""
    hf = load_hf(folder)
    for name, param in hf.named_parameters():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            param.copy_(QuantLinear.quantized(method, param.detach().clone()).dequantize())
    return hf
