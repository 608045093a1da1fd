"""An int8 copy of the LM head that picks the candidates, their logits then rescored exactly from the kept weight.

A format whose projections are 4-bit (AWQ) leaves the LM head the largest weight a decode step reads: SmolLM2's
tied 49,152 x 576 bf16 embedding is 57 MB, about half of everything an AWQ step reads. Quantizing the head outright
costs agreement (int8 logits: 1.5 points of top-1 on SmolLM2, docs/benchmarks.md), but a bf16 head already has its
top logits rescored in float32 (`layers.rescore_top_logits`): with the int8 copy scoring the vocabulary and the
bf16 weight (still held: the embedding reads it) rescoring the top candidates, the argmax is the bf16 head's
whenever it is among the int8 head's top `RESCORED_LOGITS`, and only the logits outside them (what sampling at a
temperature and the log-softmax's normalizer read) carry int8's error (per row, |error| <= scale / 2 per weight).

Used where the int8 AMX kernel runs (`kernels.cpu_gemm.linear_int8_act`, up to `cpu_gemm.MAX_ROWS` rows: decode
steps); prefill-sized steps and other CPUs multiply by the bf16 weight as before. `$MINIVLLM_INT8_HEAD=0` keeps
the bf16 head (to compare). Measured in docs/benchmarks.md (the AWQ section).
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_gemm
from worker_node.models.quant_int8 import quantize_rows

DISABLE_ENV = "MINIVLLM_INT8_HEAD"


def int8_head(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes int8 [V, H], scales float32 [V]) of a bf16 CPU head weight where the int8 kernel would multiply
    them, else None (the head stays bf16 only)."""
    if (
        os.environ.get(DISABLE_ENV) == "0"
        or weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or weight.dim() != 2
        or weight.shape[0] % cpu_gemm.BLOCK_N
        or weight.shape[1] % cpu_gemm.QUADS_K
        or not cpu_gemm.has_int8()
    ):
        return None
    codes, scales = quantize_rows(weight)
    return codes, scales.float().contiguous()


def int8_scores(hidden: torch.Tensor, head: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """The int8 head's bf16 logits [T, V] for a decode-sized step, or None (the caller uses the bf16 weight)."""
    if head is None or hidden.shape[0] > cpu_gemm.MAX_ROWS:
        return None
    return cpu_gemm.linear_int8_act(hidden, head[0], head[1], 16)
