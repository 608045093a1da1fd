"""AWQ 4-bit weights in AutoAWQ's GEMM layout, as hub checkpoints store them (`quant_method: awq`, `version: gemm`).

Per linear layer, for a weight [N out, K in] and groups of G input channels (config.json's
`quantization_config.group_size`):

- `qweight` int32 [K, N / 8]: eight 4-bit codes per int32, nibble i (bits 4i..4i+3) holding output channel
  8c + AWQ_ORDER[i] of packed column c (AutoAWQ interleaves them for its CUDA kernel's unpacking);
- `qzeros` int32 [K / G, N / 8]: the zero point of each group and output channel, packed the same way;
- `scales` float16 [K / G, N]: the scale of each group and output channel;

and w[n, k] = (code[k, n] - zero[k // G, n]) * scale[k // G, n]. Tensor parallelism cuts output channels in
eights (packed columns) and input channels in whole groups.

On CPU the codes are repacked once at load: where the CPU has AMX-BF16 (and the widths fit), into the layout of
the C kernel kernels/cpu_gemm_awq.py, which widens the codes in registers and multiplies bf16 activations; on
other CPUs (AVX2, AVX-512 without AMX) into the portable kernel's (kernels/cpu_gemm_portable.py `repack_int4`),
which widens them to float32 in registers for float32 or bf16 activations, any row count: torch's
`aten._weight_int4pack_mm_for_cpu` with float32 activations (those CPUs' default dtype) ran 9-55x slower than
float32's matmul on an AVX2 EPYC (docs/benchmarks.md). Else
(or for float32 activations on an AMX CPU, made on first use) into torch's int4 layout, multiplied by
`_weight_int4pack_mm_for_cpu`, whose dequantization is (code - 8) * scale + offset: the AWQ zero point becomes
offset = (8 - zero) * scale, exact in float32. On a GPU kernels/triton_quant_gemm.py multiplies the checkpoint's
tensors as stored, each code widened in registers; where Triton is missing each step dequantizes to the
activations' dtype and multiplies: the torch reference path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels import cpu_gemm_awq, cpu_gemm_portable
from kernels.cpu_gemm import NativeGemm
from kernels.torch_quant_gemm import PACK, awq_weight, unpack
from proto.quantization import QuantizationError
from worker_node.models.quant_linear import QuantLinear, QuantMethod, TensorAxes, gpu_kernels

GROUP_SIZES = (32, 64, 128)  # torch's int4 kernel's (and AutoAWQ's usual) groups


class AwqMethod(QuantMethod):
    name = "awq"
    int8_head = True  # with 4-bit projections the bf16 head is half of a decode step's bytes (quantize.quantize_head)

    def __init__(self, group_size: int = 128) -> None:
        self.group_size = group_size
        self._set_axes()

    def _set_axes(self) -> None:
        g = self.group_size
        self.axes = {
            "qweight": TensorAxes(out_dim=1, in_dim=0, out_pack=PACK),
            "qzeros": TensorAxes(out_dim=1, in_dim=0, out_pack=PACK, in_pack=g),
            "scales": TensorAxes(out_dim=1, in_dim=0, in_pack=g),
        }

    def check(self, device: torch.device, config: dict[str, Any]) -> None:
        """AutoAWQ GEMM, 4 bits, zero points, a group size the kernels take; each refusal names its key."""
        key = "config.json quantization_config"
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise QuantizationError(f"{key}.bits {bits!r}: AWQ checkpoints of 4 bits only")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"{key}.version {version!r}: only AutoAWQ's GEMM layout ('gemm') is supported")
        if config.get("zero_point", True) is not True:
            raise QuantizationError(f"{key}.zero_point {config['zero_point']!r}: symmetric AWQ is not supported")
        group = config.get("group_size", config.get("q_group_size", 128))
        if group not in GROUP_SIZES:
            raise QuantizationError(f"{key}.group_size {group!r}: supported group sizes are {GROUP_SIZES}")
        skipped = config.get("modules_to_not_convert") or []
        if any(p in str(m) for m in skipped for p in ("q_proj", "k_proj", "v_proj", "o_proj", "_proj", "mlp")):
            raise QuantizationError(f"{key}.modules_to_not_convert {skipped!r}: every projection must be quantized")
        self.group_size = int(group)
        self._set_axes()

    def empty(self, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        g = self.group_size
        if in_features % g or out_features % PACK:
            raise QuantizationError(
                f"config.json quantization_config.group_size {g}: a layer of {in_features} inputs and "
                f"{out_features} outputs does not split into groups of {g} inputs and packs of {PACK} outputs"
            )
        return {
            "qweight": torch.empty(in_features, out_features // PACK, dtype=torch.int32),
            "qzeros": torch.empty(in_features // g, out_features // PACK, dtype=torch.int32),
            "scales": torch.empty(in_features // g, out_features, dtype=torch.float16),
        }

    def _codes(self, layer: QuantLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes [K, N], zero points [K/G, N], scales [K/G, N] float32, from the checkpoint's tensors."""
        return unpack(layer.part("qweight")), unpack(layer.part("qzeros")), layer.part("scales").float()

    def dequantize(self, layer: QuantLinear, rows: torch.Tensor | None = None) -> torch.Tensor:
        if "awq codes" in layer.kernel:  # the C kernel's layout holds the same numbers
            codes, zeros, scales = cpu_gemm_awq.awq_tensors(layer.kernel["awq codes"], layer.kernel["awq scales"])
            w = self._weight(codes, zeros, scales)
        elif "int4 codes" in layer.kernel:  # the portable kernel's numbers, widened by the kernel
            w = self._widened(layer)
        elif "int4" in layer.kernel:  # repacked: what the kernel multiplies by, read back through it
            eye = torch.eye(layer.in_features, dtype=torch.float32, device=layer.kernel["int4"].device)
            w = self._int4_mm(layer, eye).t()
        else:
            w = self._weight(*self._codes(layer))
        return w if rows is None else w[rows]

    def _weight(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return awq_weight(codes, zeros, scales, self.group_size)

    def after_load(self, layer: QuantLinear) -> None:
        """On CPU: the C kernel's layout where it runs, else torch's int4 layout and (scale, offset) pairs; the AWQ
        tensors are released."""
        if layer.part("qweight").device.type != "cpu":  # the GPU kernel reads them as stored, contiguous
            for name in self.tensor_names:
                layer._buffers[name] = layer.part(name).contiguous()
            return
        codes, zeros, scales = self._codes(layer)
        widths = (layer.out_features, layer.in_features, self.group_size)
        chunk = cpu_gemm_portable.int4_chunk()
        if cpu_gemm_awq.load() is not None and cpu_gemm_awq.fits(*widths):
            layer.kernel["awq codes"], layer.kernel["awq scales"] = cpu_gemm_awq.repack(codes, zeros, scales)
        elif chunk is not None and cpu_gemm_portable.fits_int4(*widths):
            packed, pairs = cpu_gemm_portable.repack_int4(codes, zeros, scales, chunk)
            layer.kernel["int4 codes"], layer.kernel["int4 pairs"] = packed, pairs
        else:
            self._make_int4(layer, codes, zeros, scales)
        for name in self.tensor_names:
            layer._buffers[name] = None

    def _make_int4(self, layer: QuantLinear, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> None:
        layer.kernel["int4"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.t().contiguous(), 1)
        layer.kernel["pairs float32"] = torch.stack([scales, (8 - zeros).float() * scales], dim=-1)  # [K/G, N, 2]

    def _int4_mm(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if "int4" not in layer.kernel:  # activations the C kernel does not take (float32): torch's layout, once
            self._make_int4(layer, *cpu_gemm_awq.awq_tensors(layer.kernel["awq codes"], layer.kernel["awq scales"]))
        key = f"pairs {x.dtype}".replace("torch.", "")
        pairs = layer.kernel.get(key)
        if pairs is None:  # the (scale, offset) pairs in the activations' dtype, made once
            pairs = layer.kernel[key] = layer.kernel["pairs float32"].to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), layer.kernel["int4"], self.group_size, pairs)

    def native_gemm(self, layer: QuantLinear, rows: int, silu_gated: bool = False) -> NativeGemm | None:
        if silu_gated:
            return None
        if "int4 codes" in layer.kernel:  # `forward`'s call for bf16 rows on CPUs without AMX
            return cpu_gemm_portable.native_int4(layer.kernel["int4 codes"], layer.kernel["int4 pairs"])
        if "awq codes" not in layer.kernel:
            return None
        return cpu_gemm_awq.native_linear(layer.kernel["awq codes"], layer.kernel["awq scales"], rows)

    def _widened(self, layer: QuantLinear) -> torch.Tensor:
        w = cpu_gemm_portable.widen_int4(layer.kernel["int4 codes"], layer.kernel["int4 pairs"])
        if w is None:  # after_load made this layout only where the kernel takes it
            raise RuntimeError(f"{layer}: the portable kernel refused its own layout")
        return w

    def forward(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        gpu = gpu_kernels(x)
        if gpu is not None:
            parts = (layer.part("qweight"), layer.part("qzeros"), layer.part("scales"))
            return gpu.awq_gemm(x, *parts, self.group_size)  # type: ignore[no-any-return]
        if "int4 codes" in layer.kernel:
            # float32 prefill: widening the codes once and torch's matmul beat the kernel past 64 rows
            # (docs/benchmarks.md); bf16 rows, whose matmul is slow on these CPUs, stay with the kernel
            if x.dtype != torch.float32 or x.shape[0] <= cpu_gemm_portable.MAX_ROWS:
                out = cpu_gemm_portable.linear_int4(x, layer.kernel["int4 codes"], layer.kernel["int4 pairs"])
                if out is not None:
                    return out
            return F.linear(x, self._widened(layer).to(x.dtype))
        if "awq codes" in layer.kernel:
            out = cpu_gemm_awq.linear(x, layer.kernel["awq codes"], layer.kernel["awq scales"])
            if out is not None:
                return out
        if "int4" in layer.kernel or "awq codes" in layer.kernel:
            return self._int4_mm(layer, x)
        return F.linear(x, self.dequantize(layer).to(x.dtype))
