"""Putting a model's linear layers into a weight format (`--quantization`, a checkpoint's `quantization_config`).

Quantized: every decoder layer's projections (fused q/k/v, o, fused gate/up, down). The LM head and the embedding
stay in the model dtype in every format, as vLLM keeps them (int8 logits alone cost 1.5 points of top-1 agreement
on SmolLM2: docs/benchmarks.md; AWQ checkpoints store the head unquantized), and so do norms, biases, a MoE router
and stacked experts. One addition for int8 and AWQ where a C int8 kernel runs on CPU (`quantize_head`: AMX-INT8,
or the portable kernel of kernels/cpu_gemm_portable.py): the head also gets int8 codes of its rows, which score every
token, the top candidates rescored from the kept weight (layers.py's `ParallelLMHead`): a decode step reads half
the head's bytes (a quarter in float32), for 1 byte per head weight more memory.

The model is built on meta with `QuantLinear`s in place (`prepare_model`), and the loader fills their tensors
through `QuantizedCheckpoint`: a checkpoint's own quantized tensors, or ones quantized from its full-precision
weight the first time a part is asked for.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import cpu_gemm, cpu_gemm_portable
from proto.quantization import QuantizationError
from worker_node.models.layers import ParallelLMHead
from worker_node.models.quant_awq import AwqMethod
from worker_node.models.quant_fp8 import Fp8Method
from worker_node.models.quant_int8 import Int8Method, quantize_rows
from worker_node.models.quant_linear import QuantLinear, QuantMethod, TensorAxes

QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The checkpoint's modules behind them (and fused as some checkpoints store them).
CHECKPOINT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *QUANTIZED_LINEARS)

METHODS: dict[str, type[QuantMethod]] = {"int8": Int8Method, "awq": AwqMethod, "fp8": Fp8Method}


def make_method(name: str, device: torch.device, config: dict[str, Any] | None = None) -> QuantMethod:
    """The method of format `name` on `device` (`config`: the checkpoint's quantization_config)."""
    if name not in METHODS:
        raise QuantizationError(f"--quantization {name}: no implementation (available: {', '.join(METHODS)})")
    method = METHODS[name]()
    method.check(device, config or {})
    return method


def prepare_model(model: nn.Module, method: QuantMethod) -> None:
    """Replace the (meta) model's projections by empty `method` layers."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in QUANTIZED_LINEARS:
                quantized = QuantLinear.empty(method, child.out_features, child.in_features, child.bias is not None)
                quantized.role = child_name
                setattr(module, child_name, quantized)


def cast_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`model.to(device, dtype)`, except that quantized layers cast only what their format lets follow the dtype."""
    model.to(device=device)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.cast(dtype)
        else:
            module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)


def after_load(model: nn.Module) -> None:
    """Each quantized layer's method prepares it for its kernel, once it is on its device in its dtype."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.method.after_load(module)


def quantize_head(model: nn.Module, method: QuantMethod | None) -> bool:
    """int8 codes for the LM head beside its weight (formats with `int8_head`: int8, and AWQ, whose 4-bit projections
    leave the head half of a decode step's bytes; on a CPU where a C kernel multiplies them, which alone makes them
    pay: elsewhere the head stays as it is). Whether the head got them."""
    head = getattr(model, "lm_head", None)
    if method is None or not method.int8_head or not isinstance(head, ParallelLMHead):
        return False
    weight = head.weight
    if weight.device.type != "cpu" or cpu_gemm_portable.load() is None and not cpu_gemm.has_int8():
        return False
    codes, scales = quantize_rows(weight)
    if cpu_gemm_portable.scores(weight[:1], codes, scales) is None:  # a dtype or width the kernels do not take
        return False
    head.int8 = (codes, scales.contiguous())
    return True


def quant_axes(method: QuantMethod | None, name: str) -> TensorAxes:
    """How TP cuts the tensor behind our parameter `name`: a quantized tensor's own axes, else a weight's."""
    if method is not None:
        part = name.rsplit(".", 1)[-1]
        if part in method.axes:
            return method.axes[part]
    return TensorAxes(0, 1)


class QuantizedCheckpoint:
    """A checkpoint seen through a format. `made_on_load`: a full-precision checkpoint, whose `prefix.weight` is
    quantized the first time one of the format's tensors under `prefix` is asked for (every part is handed out,
    then forgotten); else a checkpoint in the format, whose tensors the method puts in the shape it holds."""

    def __init__(self, hf: Any, method: QuantMethod, made_on_load: bool) -> None:
        self.hf, self.method, self.made_on_load = hf, method, made_on_load
        self._made: dict[str, dict[str, torch.Tensor]] = {}

    def _quantized(self, prefix: str, part: str) -> bool:
        """Whether `prefix.part` is one of the format's tensors of a quantized layer (not a norm's weight)."""
        return part in self.method.axes and prefix.rsplit(".", 1)[-1] in CHECKPOINT_LINEARS

    def __contains__(self, name: str) -> bool:
        prefix, _, part = name.rpartition(".")
        if self.made_on_load and self._quantized(prefix, part):
            return f"{prefix}.weight" in self.hf
        return name in self.hf

    def __getitem__(self, name: str) -> torch.Tensor:
        prefix, _, part = name.rpartition(".")
        if not self._quantized(prefix, part):
            return self.hf[name]
        if not self.made_on_load:
            return self.method.from_checkpoint(part, self.hf[name], lambda: self.hf[f"{prefix}.weight"].shape[0])
        if prefix not in self._made:
            self._made[prefix] = self.method.quantize(self.hf[f"{prefix}.weight"])
        made = self._made[prefix]
        tensor = made.pop(part)
        if not made:
            del self._made[prefix]
        return tensor

    def close(self) -> None:
        self.hf.close()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: parameters and quantized tensors, a shared one once."""
    tensors: dict[int, torch.Tensor] = {t.data_ptr(): t for t in model.parameters()}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            tensors.update({t.data_ptr(): t for t in module.held_tensors()})
        if isinstance(module, ParallelLMHead) and module.int8 is not None:
            tensors.update({t.data_ptr(): t for t in module.int8})
    return sum(t.numel() * t.element_size() for t in tensors.values())
