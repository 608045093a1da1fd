"""The weight formats one field at a time: AutoAWQ's nibble order, each kernel against its format's dequantized
weights, and the refusals at start (a format the checkpoint contradicts, a group size or layout we cannot run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from proto.quantization import QuantizationError, resolve_quantization
from tests.support.awq_checkpoint import pack_columns, quantize_awq
from worker_node.models.quant_awq import AwqMethod, pack, unpack
from worker_node.models.quant_int8 import Int8Method
from worker_node.models.quant_linear import QuantLinear

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_awq_nibbles_follow_autoawq_order() -> None:
    """Channels 0..7 with codes 1..8: nibble i (bits 4i..4i+3) holds channel [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    word = 1 | 3 << 4 | 5 << 8 | 7 << 12 | 2 << 16 | 4 << 20 | 6 << 24 | 8 << 28
    expected = torch.tensor([[word - 2**32]], dtype=torch.int32)  # the top nibble 8 sets the sign bit
    assert torch.equal(pack(codes), expected)
    assert torch.equal(pack_columns(codes), expected)
    assert torch.equal(unpack(expected), codes.int())
    many = torch.randint(0, 16, (5, 64))
    assert torch.equal(unpack(pack_columns(many)), many.int())


def _awq_layer(out_features: int, in_features: int, group: int) -> tuple[QuantLinear, torch.Tensor]:
    method = AwqMethod()
    method.check(CPU, {"group_size": group})
    codes, zeros, scales, dequantized = quantize_awq(torch.randn(out_features, in_features), group)
    tensors = {"qweight": pack_columns(codes), "qzeros": pack_columns(zeros), "scales": scales}
    return QuantLinear(method, tensors, out_features, in_features), dequantized


@pytest.mark.parametrize("rows", [1, 7])
def test_awq_int4_kernel_multiplies_by_the_checkpoint_weights(rows: int) -> None:
    layer, dequantized = _awq_layer(48, 256, 128)
    assert torch.equal(layer.dequantize(), dequantized)
    x = torch.randn(rows, 256)
    layer.method.after_load(layer)  # repacked for torch's int4 kernel, the AWQ tensors released
    assert "int4" in layer.kernel and layer._buffers["qweight"] is None
    torch.testing.assert_close(layer(x), x @ dequantized.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.dequantize(), dequantized, rtol=0, atol=1e-6)
    bf16 = layer(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    assert _relative_error(bf16, x.bfloat16().float() @ dequantized.t()) < 0.01


@pytest.mark.parametrize("rows", [1, 4, 5, 64])  # the packed GEMV up to 4 rows, convert-and-multiply beyond
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernels_multiply_by_the_dequantized_weights(rows: int, dtype: torch.dtype) -> None:
    weight = torch.randn(40, 96)
    layer = QuantLinear.quantized(Int8Method(), weight)
    layer.cast(dtype)
    reference = layer.dequantize()  # with the scales as the layer holds them: bf16 numbers in either dtype
    steps = layer.part("scales").float()[:, None]
    assert ((reference - weight).abs() <= steps / 2 + 1e-6).all()  # half a step per channel, none clipped
    x = torch.randn(rows, 96)
    out = layer(x.to(dtype))
    expected = x.to(dtype).float() @ reference.t()
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert _relative_error(out, expected) < 0.01


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


def _folder(tmp_path: Path, quantization_config: dict | None) -> Path:
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_checkpoint_format_wins_and_a_contradicting_flag_is_refused(tmp_path: Path) -> None:
    awq = _folder(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128})
    assert resolve_quantization("auto", awq) == "awq"
    assert resolve_quantization("awq", awq) == "awq"
    with pytest.raises(QuantizationError, match=r"--quantization int8: .* awq checkpoint .*quant_method"):
        resolve_quantization("int8", awq)


def test_a_format_a_full_precision_checkpoint_cannot_become_is_refused(tmp_path: Path) -> None:
    full = _folder(tmp_path, None)
    assert resolve_quantization("auto", full) == "none"
    assert resolve_quantization("int8", full) == "int8"
    with pytest.raises(QuantizationError, match=r"--quantization awq: .* full-precision checkpoint"):
        resolve_quantization("awq", full)
    with pytest.raises(QuantizationError, match="quantization: must be one of"):
        resolve_quantization("int3", full)


def test_an_unknown_checkpoint_method_is_named(tmp_path: Path) -> None:
    gptq = _folder(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(QuantizationError, match=r"quantization_config.quant_method 'gptq' is not supported"):
        resolve_quantization("auto", gptq)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"group_size": 100}, "quantization_config.group_size 100"),
        ({"bits": 8}, "quantization_config.bits 8"),
        ({"version": "gemv"}, "quantization_config.version 'gemv'"),
        ({"zero_point": False}, "quantization_config.zero_point False"),
        ({"modules_to_not_convert": ["down_proj"]}, "quantization_config.modules_to_not_convert"),
    ],
)
def test_awq_configs_we_cannot_run_are_refused_naming_the_key(config: dict, key: str) -> None:
    with pytest.raises(QuantizationError, match=key):
        AwqMethod().check(CPU, config)


def test_a_layer_that_groups_do_not_divide_is_refused() -> None:
    method = AwqMethod()
    method.check(CPU, {"group_size": 128})
    with pytest.raises(QuantizationError, match="group_size 128: a layer of 576 inputs"):
        method.empty(960, 576)
