"""An AutoAWQ-layout checkpoint written from a full-precision HF folder, packed here by the format's own rules
(AutoAWQ's WQLinear_GEMM.from_linear), independently of worker_node/models/quant_awq.py, and the weights it
stands for.

Per projection W [N, K], per group of G input channels and output channel: asymmetric 4-bit, scale =
(max - min) / 15 rounded to float16, zero = round(-min / scale) in 0..15, code = clamp(round(w / scale) + zero,
0, 15); stored as qweight int32 [K, N/8], qzeros int32 [K/G, N/8] (nibble i of packed column c holding channel
8c + ORDER[i]) and scales float16 [K/G, N]; w' = (code - zero) * scale.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map for 4 bits
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """int [R, 8C] -> int32 [R, C], as AutoAWQ's loop packs them: qweight[:, c] |= v[:, 8c + ORDER[i]] << 4i."""
    out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for c in range(values.shape[1] // 8):
        for i in range(8):
            out[:, c] |= values[:, c * 8 + ORDER[i]].to(torch.int64) << (i * 4)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def quantize_awq(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [K, N], zeros [K/G, N], scales float16 [K/G, N], the dequantized W [N, K] float32) of W [N, K]."""
    n, k = w.shape
    grouped = w.float().reshape(n, k // group, group)
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()  # [N, K/G]
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    codes = (torch.round(grouped / scales.float()[..., None]) + zeros[..., None]).clamp(0, 15)
    dequant = ((codes - zeros[..., None]) * scales.float()[..., None]).reshape(n, k)
    return codes.reshape(n, k).t().int(), zeros.t().int(), scales.t().contiguous(), dequant


def write_awq_checkpoint(source: Path, folder: Path, group: int) -> dict[str, torch.Tensor]:
    """`source` (an HF safetensors folder) rewritten in AutoAWQ's layout into `folder`; the dequantized weights
    under their HF names (what HF should run on to match)."""
    shutil.copytree(source, folder)
    state = load_file(str(source / "model.safetensors"))
    out, dequantized = {}, {}
    for name, tensor in state.items():
        prefix, _, kind = name.rpartition(".")
        if kind == "weight" and prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            codes, zeros, scales, dequantized[name] = quantize_awq(tensor, group)
            out[f"{prefix}.qweight"] = pack_columns(codes)
            out[f"{prefix}.qzeros"] = pack_columns(zeros)
            out[f"{prefix}.scales"] = scales
        else:
            out[name] = tensor
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized
