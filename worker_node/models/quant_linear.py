"""Quantized linear layers: one module, one method per weight format.

A `QuantLinear` holds its format's tensors (int8 rows and their scales; AWQ's packed nibbles, zero points and group
scales; fp8 rows and scales) as buffers and asks its `QuantMethod` to multiply. A method knows:

- its tensors' shapes and how tensor parallelism cuts them (`axes`: which dim holds output channels and which
  input channels, and how many channels one stored element packs), so the loader slices them per rank exactly as
  it slices a full-precision weight, scales and zero points following their channels;
- how to make them from a full-precision weight (`quantize`, on load) when the checkpoint is not in the format;
- how to multiply activations by them on this device (the fastest measured kernel per row count);
- how to give back the full-precision weight they stand for (`dequantize`): the reference the fidelity tests
  compare against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

from kernels.cpu_gemm import NativeGemm


def gpu_kernels(x: torch.Tensor) -> ModuleType | None:
    """kernels/triton_quant_gemm (the GPU path of AWQ and int8 weights) for activations `x` on a GPU where Triton
    imports; None elsewhere (on a GPU without Triton the layers dequantize and multiply, the reference path)."""
    return _triton_quant_gemm() if x.is_cuda else None


@functools.cache
def _triton_quant_gemm() -> ModuleType | None:
    try:
        from kernels import triton_quant_gemm
    except ImportError:
        return None
    return triton_quant_gemm


class TensorAxes(NamedTuple):
    """Where a quantized tensor keeps its channels: the dim of output channels and of input channels (None: not
    cut by that kind of parallelism), and how many channels one stored element stands for along each."""

    out_dim: int | None
    in_dim: int | None
    out_pack: int = 1
    in_pack: int = 1


class QuantMethod:
    """One weight format: `axes` names its tensors and says how TP cuts them."""

    name = ""
    axes: dict[str, TensorAxes] = {}
    follows_model_dtype: tuple[str, ...] = ()  # tensors cast to the model dtype; the others keep their own
    int8_head = False  # whether the LM head gets an int8 copy that picks candidates (quantize.quantize_head)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    def check(self, device: torch.device, config: dict[str, Any]) -> None:
        """Refuse (QuantizationError naming the key) a device without a path or a checkpoint config we cannot read."""

    def from_checkpoint(self, part: str, tensor: torch.Tensor, rows: Callable[[], int]) -> torch.Tensor:
        """A tensor as a checkpoint in this format stores it, in the shape the layer holds (`rows()`: the layer's
        output channels, read only when needed)."""
        return tensor

    def empty(self, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        """Uninitialised tensors of the format's shapes (built on meta, then assigned from the checkpoint)."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """This format's tensors for a full-precision weight [out, in] (float32 preferred: scales come from it)."""
        raise ValueError(f"{self.name} weights cannot be made from a full-precision checkpoint")

    def forward(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] times the layer's weight, transposed: [T, out] in x's dtype."""
        raise NotImplementedError

    def dequantize(self, layer: QuantLinear, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The full-precision weight [out, in] (or its `rows`, output channels) in float32."""
        raise NotImplementedError

    def after_load(self, layer: QuantLinear) -> None:
        """Once the layer is on its device in its dtype: repack for the kernel if needed."""

    def native_gemm(self, layer: QuantLinear, rows: int, silu_gated: bool = False) -> NativeGemm | None:
        """The one kernel call `forward` (or, `silu_gated`, `forward_silu_gated`) makes for `rows` bf16 rows on
        CPU, for kernels/csrc/decode_layers_cpu.c to make; None where it makes another (or several)."""
        return None


class QuantLinear(nn.Module):
    """A linear layer whose weight is kept in a quantized format (`method`); the bias stays full precision."""

    def __init__(
        self,
        method: QuantMethod,
        tensors: dict[str, torch.Tensor],
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.method = method
        self.out_features, self.in_features = out_features, in_features
        for name in method.tensor_names:
            self.register_buffer(name, tensors[name])
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.kernel: dict[str, Any] = {}  # what the method's kernel keeps (a repacked weight), by the method
        self.role = ""  # which projection it is ("qkv_proj", "down_proj", ...), where a method treats them apart

    @classmethod
    def empty(cls, method: QuantMethod, out_features: int, in_features: int, bias: bool = False) -> QuantLinear:
        tensors = method.empty(out_features, in_features)
        return cls(method, tensors, out_features, in_features, torch.empty(out_features) if bias else None)

    @classmethod
    def quantized(cls, method: QuantMethod, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear:
        out_features, in_features = weight.shape
        return cls(method, method.quantize(weight), out_features, in_features, bias)

    def part(self, name: str) -> torch.Tensor:
        """One of the format's tensors (a buffer)."""
        tensor = self._buffers[name]
        if tensor is None:
            raise RuntimeError(f"{name} was released when the layer was repacked for its kernel")
        return tensor

    def held_tensors(self) -> list[torch.Tensor]:
        """What the layer holds: its format's tensors still kept and its kernel's."""
        kept = [t for t in self._buffers.values() if t is not None]
        return kept + [t for t in self.kernel.values() if isinstance(t, torch.Tensor)]

    def cast(self, dtype: torch.dtype) -> None:
        """The bias and the tensors that follow the model dtype to `dtype`; codes, zero points and scales the
        format keeps in their own dtype stay (an fp8 weight is a float that must not become bf16)."""
        for name in self.method.follows_model_dtype:
            self._buffers[name] = self.part(name).to(dtype)
        if self.bias is not None:
            self.bias.data = self.bias.data.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.forward(self, x)
        return y if self.bias is None else y + self.bias

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.method.dequantize(self, rows)

    def native_gemm(self, rows: int, silu_gated: bool = False) -> NativeGemm | None:
        return None if self.bias is not None else self.method.native_gemm(self, rows, silu_gated)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.method.name}"
