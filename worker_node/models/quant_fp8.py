"""fp8 (e4m3) weights with one float32 scale per output channel: quantized on load from a bf16/fp32 checkpoint, or
read from an fp8 checkpoint (`quant_method: fp8`, a per-tensor or per-channel `weight_scale` beside each
`weight`; a per-tensor scale becomes one per channel, so q/k/v with their own scales fuse).

w[n, k] ~ weight[n, k] * weight_scale[n]. On GPUs with fp8 tensor cores (compute capability 8.9+: Ada, Hopper)
`torch._scaled_mm` multiplies fp8 activations (quantized per row each step) by the fp8 weights with both scales
applied in its epilogue. On CPUs without AMX (kernels/cpu_isa.py: AVX-512 BF16, AVX2) bf16 rows of a decode step
go to kernels/csrc/vector_gemm_cpu.c, which widens the codes in registers as it reads them (a decode step reads
half bf16's bytes; the decode runner takes that call too, `native_gemm`); everywhere else the weights are
converted to the activations' dtype each step (memory halved against bf16, no speed-up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels import cpu_gemm
from proto.quantization import QuantizationError
from worker_node.models.quant_linear import QuantLinear, QuantMethod, TensorAxes

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def has_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Method(QuantMethod):
    name = "fp8"
    axes = {"weight": TensorAxes(0, 1), "weight_scale": TensorAxes(0, None)}

    def check(self, device: torch.device, config: dict[str, Any]) -> None:
        key = "config.json quantization_config"
        block = config.get("weight_block_size")
        if block:
            raise QuantizationError(f"{key}.weight_block_size {block!r}: block-wise fp8 scales are not supported")
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise QuantizationError(f"{key}.fmt {fmt!r}: only e4m3 fp8 weights are supported")

    def empty(self, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        return {"weight": torch.empty(out_features, in_features, dtype=FP8), "weight_scale": torch.empty(out_features)}

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        amax = w.abs().amax(dim=1)
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return {"weight": (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), "weight_scale": scales}

    def from_checkpoint(self, part: str, tensor: torch.Tensor, rows: Callable[[], int]) -> torch.Tensor:
        """A checkpoint's per-tensor ([] or [1]) or per-channel ([N] or [N, 1]) weight_scale as [N] float32."""
        if part != "weight_scale":
            return tensor
        scale = tensor.float().reshape(-1)
        return scale.expand(rows()).clone() if scale.numel() == 1 else scale

    def dequantize(self, layer: QuantLinear, rows: torch.Tensor | None = None) -> torch.Tensor:
        w, scales = layer.part("weight"), layer.part("weight_scale")
        if rows is not None:
            w, scales = w[rows], scales[rows]
        return w.float() * scales.float().unsqueeze(-1)

    def forward(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        w, scales = layer.part("weight"), layer.part("weight_scale")
        # row-wise scaled fp8 GEMMs want bf16 out and 16-aligned K and N; anything else takes the reference path
        if has_fp8_matmul(x.device) and x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0 and w.shape[0] % 16 == 0:
            x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
            xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scales[None, :], out_dtype=x.dtype)
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            out = cpu_gemm.linear_int8(x, w, self._float_scales(layer))
            if out is not None:
                return out
        return F.linear(x, w.to(x.dtype)) * scales.to(x.dtype)

    def native_gemm(self, layer: QuantLinear, rows: int, silu_gated: bool = False) -> cpu_gemm.NativeGemm | None:
        """The kernel call `forward` makes for `rows` bf16 rows on CPU (the vector kernel's fp8 format)."""
        if silu_gated:
            return None
        return cpu_gemm.native_linear(layer.part("weight"), rows, self._float_scales(layer))

    def _float_scales(self, layer: QuantLinear) -> torch.Tensor:
        """The scales in float32 for the C kernel, made once."""
        scales = layer.kernel.get("scales float32")
        if scales is None:
            scales = layer.kernel["scales float32"] = layer.part("weight_scale").float().contiguous()
        return scales
