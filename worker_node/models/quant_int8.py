"""int8 weights, one float scale per output channel (activations keep about their own precision: 16-bit codes).

w[n, k] ~ qweight[n, k] * scales[n], qweight in [-127, 127]. The multiplication picks its kernel by row count,
as measured on a 2-core Sapphire Rapids (scripts/bench_quant.py --kernels, docs/benchmarks.md):

- bf16 activations on CPU with AMX-INT8, inputs a multiple of 64, any row count (decode steps and prefill):
  kernels/cpu_gemm.py's `linear_int8_act`, the codes straight from memory into AMX-INT8 tile products against the
  activations quantized per row in the call. 16 bits per activation (two int8 halves) by default: 8 bits (W8A8)
  halves the tile products but cost SmolLM2 its agreement with bf16 on every projection (88.5 % with all four,
  94.5-97.5 % with any one alone, against 98.3 % here: docs/benchmarks.md), so `ACT_BITS` keeps 16 everywhere;
- other AMX CPUs (or widths): the same C kernel with the codes widened to bf16 in registers;
- float32 activations on any CPU, bf16 on others (AVX2, AVX-512 without AMX), up to `cpu_gemm_portable.MAX_ROWS` rows:
  kernels/cpu_gemm_portable.py's portable kernel, the codes widened to float32 in registers, each read once per
  call (on a loaded 2-core Zen 3, one thread: 1.6-2.7x float32's matmul at 1 to 64 rows: docs/benchmarks.md);
- bf16 activations where no C kernel loads, up to `GEMV_ROWS` rows: torch's packed int8 GEMV
  (`aten._weight_int8pack_mm`), which reads the int8 rows directly but walks them once per row;
- on a GPU: kernels/triton_quant_gemm.py, the codes widened in registers, the scales applied to the float32 sums;
- otherwise: the int8 rows converted to the activations' dtype and multiplied, the scales applied to the output
  (x @ (q * s)^T == (x @ q^T) * s): the reference path, prefill's without AMX-INT8, and a GPU's without Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_gemm_portable
from settings.fast_paths import INT8_PROJECTIONS, act_bits_overrides
from worker_node.models.quant_linear import QuantLinear, QuantMethod, TensorAxes, gpu_kernels

GEMV_ROWS = 4
QMAX = 127
# Activation bits per projection in the AMX-INT8 kernel (kernels/cpu_gemm.py's `linear_int8_act`): 8 is W8A8,
# 16 about bf16's precision. A worker's --int8-act-bits overrides them to compare (settings/fast_paths.py), set as a
# rank loads: a module-level switch, as the projections ask for it deep in their products.
ACT_BITS = dict.fromkeys(INT8_PROJECTIONS, 16)
_act_bits = [dict(ACT_BITS)]


def set_act_bits(overrides: str) -> None:
    """`ACT_BITS` with --int8-act-bits's overrides ("8", or "qkv_proj=8,down_proj=16"; "" for none) from now on;
    ValueError naming an entry that is neither."""
    _act_bits[0] = ACT_BITS | act_bits_overrides(overrides)


def act_bits() -> dict[str, int]:
    """Each projection's activation bits."""
    return _act_bits[0]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (qweight int8 [N, K], scales float32 [N]); an all-zero row gets scale 1.

    The scales are bf16 numbers (rounded up, so no code clips): a bf16 model multiplies by them in bf16, and
    rounding them after quantizing would scale each row by up to 1 +- 2^-8 on top of the codes' own error."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    exact = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    scales = exact.bfloat16().float()
    scales = torch.where(scales < exact, (scales * (1 + 2**-7)).bfloat16().float(), scales)
    q = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


class Int8Method(QuantMethod):
    name = "int8"
    int8_head = True  # the head's int8 codes pick candidates (quantize.quantize_head)
    axes = {"qweight": TensorAxes(0, 1), "scales": TensorAxes(0, None)}
    follows_model_dtype = ("scales",)  # the packed GEMV takes them in the activations' dtype

    def empty(self, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        return {
            "qweight": torch.empty(out_features, in_features, dtype=torch.int8),
            "scales": torch.empty(out_features),
        }

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_rows(weight)
        return {"qweight": q, "scales": scales}

    def forward(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        q, scales = layer.part("qweight"), layer.part("scales")
        gpu = gpu_kernels(x)
        if gpu is not None:
            return gpu.int8_gemm(x, q, self._float_scales(layer))  # type: ignore[no-any-return]
        if x.device.type == "cpu":
            out = self._amx(layer, x) if x.dtype == torch.bfloat16 else None
            if out is None:
                out = cpu_gemm_portable.linear(x, q, self._float_scales(layer))
            if out is not None:
                return out
        if x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[0] <= GEMV_ROWS:
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scales.to(x.dtype))
        return F.linear(x, q.to(x.dtype)) * scales.to(x.dtype)

    def _amx(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor | None:
        """The AMX kernels' product where they cover x: activations quantized per row (8 or 16 bits, any row
        count: at prefill's 128-512 rows one call beat converting the codes for torch's matmul, 0.69 vs 1.21 ms
        a layer at 128 and even at 512, docs/benchmarks.md), else the weight-only kernel (codes widened to bf16)
        up to `cpu_gemm.MAX_ROWS`; None beyond."""
        q, scales = layer.part("qweight"), self._float_scales(layer)
        out = cpu_gemm.linear_int8_act(x, q, scales, act_bits().get(layer.role, 16))
        return out if out is not None else cpu_gemm.linear_int8(x, q, scales)

    def forward_silu_gated(self, layer: QuantLinear, gate_up: torch.Tensor) -> torch.Tensor | None:
        """The layer (a gated MLP's down projection) times silu(gate) * up of the MLP's [T, 2K] gate/up output,
        in one AMX-INT8 call where `_amx` would run the kernel (the activation made as the rows are quantized:
        two elementwise passes and a temporary fewer); None elsewhere (the caller multiplies as usual)."""
        if gate_up.device.type != "cpu" or gate_up.dtype != torch.bfloat16 or layer.bias is not None:
            return None
        q, scales = layer.part("qweight"), self._float_scales(layer)
        return cpu_gemm.linear_int8_act(gate_up, q, scales, act_bits().get(layer.role, 16), silu_gated=True)

    def native_gemm(self, layer: QuantLinear, rows: int, silu_gated: bool = False) -> cpu_gemm.NativeGemm | None:
        q, scales = layer.part("qweight"), self._float_scales(layer)
        bits = act_bits().get(layer.role, 16)
        native = cpu_gemm.native_int8_act(q, scales, bits, silu_gated)
        if native is not None or silu_gated:
            return native
        return cpu_gemm.native_linear(q, rows, scales)

    def _float_scales(self, layer: QuantLinear) -> torch.Tensor:
        """The scales in float32 for the C kernel, made once (the buffer follows the model dtype; bf16 numbers
        by construction, so widening them is exact)."""
        scales = layer.kernel.get("scales float32")
        if scales is None:
            scales = layer.kernel["scales float32"] = layer.part("scales").float().contiguous()
        return scales

    def dequantize(self, layer: QuantLinear, rows: torch.Tensor | None = None) -> torch.Tensor:
        q, scales = layer.part("qweight"), layer.part("scales")
        if rows is not None:
            q, scales = q[rows], scales[rows]
        return q.float() * scales.float().unsqueeze(-1)
