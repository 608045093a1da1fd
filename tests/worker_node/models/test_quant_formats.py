"""The weight formats one field at a time: AutoAWQ's nibble order, each kernel against its format's dequantized
weights, and the refusals at start (a format the checkpoint contradicts, a group size or layout we cannot run)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_gemm_awq, cpu_gemm_portable
from kernels.torch_quant_gemm import pack, unpack
from proto.quantization import QuantizationError
from tests.support.awq_checkpoint import pack_columns, quantize_awq
from worker_node.models import quant_int8
from worker_node.models.layers import RESCORED_INT8_LOGITS, ParallelLMHead, silu_gated_product
from worker_node.models.quant_awq import AwqMethod
from worker_node.models.quant_fp8 import FP8, Fp8Method
from worker_node.models.quant_int8 import Int8Method
from worker_node.models.quant_linear import QuantLinear
from worker_node.models.quantize import QuantizedCheckpoint, quantize_head, weight_bytes
from worker_node.runtime.parallel import SINGLE, Comm

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
HAS_INT8_KERNEL = cpu_gemm.has_int8() or cpu_gemm_portable.load() is not None


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


@pytest.mark.parametrize("rows", [1, 7, 70])  # 70: past 64 float32 rows, the widened codes times torch's matmul
def test_awq_int4_kernel_multiplies_by_the_checkpoint_weights(rows: int) -> None:
    layer, dequantized = _awq_layer(48, 256, 128)
    assert torch.equal(layer.dequantize(), dequantized)
    x = torch.randn(rows, 256)
    layer.method.after_load(layer)  # repacked for a C kernel (AMX's, the portable one) or torch's, the AWQ tensors
    amx, portable = cpu_gemm_awq.load() is not None, cpu_gemm_portable.load() is not None  # released
    kernel = "awq codes" if amx else "int4 codes" if portable else "int4"
    assert kernel in layer.kernel and layer._buffers["qweight"] is None
    # float32 sums of 256 products (|terms| up to ~10) in another order than `@`'s: ~1e-5 apart (one CI run saw
    # 1.3e-5); a wrong code, zero or scale is off by the weights' size (>= 1e-2)
    torch.testing.assert_close(layer(x), x @ dequantized.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.dequantize(), dequantized, rtol=0, atol=1e-6)
    bf16 = layer(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    assert _relative_error(bf16, x.bfloat16().float() @ dequantized.t()) < 0.01
    # float32 activations made torch's layout on AMX CPUs (the AMX kernel takes bf16 only); the portable one takes both
    assert ("int4" in layer.kernel) == (amx or not portable)


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


@pytest.mark.parametrize(
    ("overrides", "changed"),
    [("", {}), ("8", dict.fromkeys(quant_int8.ACT_BITS, 8)), ("down_proj=8", {"down_proj": 8})],
)
def test_activation_bits_per_projection_and_their_override(overrides: str, changed: dict[str, int]) -> None:
    """A worker's --int8-act-bits, set as it loads (worker_node/loading.py set_kernel_switches)."""
    quant_int8.set_act_bits(overrides)
    try:
        assert quant_int8.act_bits() == {**quant_int8.ACT_BITS, **changed}
    finally:
        quant_int8.set_act_bits("")
    assert quant_int8.act_bits() == quant_int8.ACT_BITS


@pytest.mark.parametrize("overrides", ["4", "lm_head=8", "down_proj=", "down_proj=eight"])
def test_a_bad_activation_bits_override_is_refused_naming_the_setting(overrides: str) -> None:
    with pytest.raises(ValueError, match="int8_act_bits"):
        quant_int8.set_act_bits(overrides)
    assert quant_int8.act_bits() == quant_int8.ACT_BITS, "a refused override changes nothing"


@pytest.mark.skipif(not cpu_gemm.has_int8(), reason="the activation-quantizing kernel needs AMX-INT8")
@pytest.mark.parametrize(("role", "rows"), [("down_proj", 16), ("down_proj", 200), ("", 3)])
def test_an_int8_layer_on_amx_quantizes_its_activations_by_its_projection(role: str, rows: int) -> None:
    """Decode steps and prefill alike go to the AMX-INT8 kernel with the projection's bits (16 by default)."""
    layer = QuantLinear.quantized(Int8Method(), torch.randn(48, 128))
    layer.cast(torch.bfloat16)
    layer.role = role
    x = torch.randn(rows, 128).bfloat16()
    scales = layer.part("scales").float()
    want = cpu_gemm.linear_int8_act(x, layer.part("qweight"), scales, quant_int8.act_bits().get(role, 16))
    assert want is not None and torch.equal(layer(x), want)
    converted = torch.nn.functional.linear(x, layer.part("qweight").bfloat16()) * layer.part("scales")
    assert _relative_error(want, converted.float()) < 0.01  # what torch's matmul of the converted codes gives


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


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


def test_fp8_multiplies_by_its_dequantized_weights_and_reads_per_tensor_scales() -> None:
    weight = torch.randn(32, 64)
    method = Fp8Method()
    layer = QuantLinear.quantized(method, weight)
    assert layer.part("weight").dtype == FP8
    layer.cast(torch.bfloat16)
    assert layer.part("weight").dtype == FP8 and layer.part("weight_scale").dtype == torch.float32  # kept
    reference = layer.dequantize()
    assert ((reference - weight).abs() <= weight.abs().amax(1, keepdim=True) / 8).all()  # 3 mantissa bits
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ reference.t(), rtol=1e-5, atol=1e-5)
    per_tensor = method.from_checkpoint("weight_scale", torch.tensor(0.5), lambda: 32)
    assert per_tensor.shape == (32,) and bool((per_tensor == 0.5).all())
    per_channel = method.from_checkpoint("weight_scale", torch.rand(32, 1), lambda: 32)
    assert per_channel.shape == (32,)
    with pytest.raises(QuantizationError, match=r"quantization_config.weight_block_size \[128, 128\]"):
        method.check(CPU, {"weight_block_size": [128, 128]})


class _Dict:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        pass


def test_quantizing_on_load_makes_a_projection_s_tensors_and_passes_a_norm_through() -> None:
    proj, norm = torch.randn(8, 16), torch.randn(16)
    hf = _Dict({"model.layers.0.self_attn.q_proj.weight": proj, "model.layers.0.input_layernorm.weight": norm})
    fp8 = QuantizedCheckpoint(hf, Fp8Method(), made_on_load=True)
    assert fp8["model.layers.0.self_attn.q_proj.weight"].dtype == FP8  # the projection's "weight" is made
    assert fp8["model.layers.0.self_attn.q_proj.weight_scale"].shape == (8,)
    assert torch.equal(fp8["model.layers.0.input_layernorm.weight"], norm)  # a norm's is not
    int8 = QuantizedCheckpoint(hf, Int8Method(), made_on_load=True)
    assert "model.layers.0.self_attn.q_proj.qweight" in int8
    assert "model.layers.0.self_attn.k_proj.qweight" not in int8
    assert int8["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.int8


def test_weight_bytes_count_a_quantized_layer_s_codes_and_scales() -> None:
    layer = QuantLinear.quantized(Int8Method(), torch.randn(8, 16))
    assert weight_bytes(layer) == 8 * 16 + 8 * 4


@pytest.mark.skipif(cpu_gemm_portable.load() is None, reason="the portable int8 kernel needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_layer_runs_the_portable_kernel_where_amx_does_not(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and cpu_gemm.has_int8():
        pytest.skip("bf16 rows go to the AMX-INT8 kernel first on this CPU")
    layer = QuantLinear.quantized(Int8Method(), torch.randn(40, 96))
    layer.cast(dtype)
    x = torch.randn(17, 96).to(dtype)
    want = cpu_gemm_portable.linear(x, layer.part("qweight"), layer.part("scales").float())
    assert want is not None and torch.equal(layer(x), want)


def _head(vocab: int, hidden: int, dtype: torch.dtype = torch.bfloat16) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden, SINGLE, Comm(SINGLE))
    head.weight.data = (torch.randn(vocab, hidden) * 0.05).to(dtype)
    return head


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason="the int8 LM head needs a C int8 kernel (a compiler)")
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_int8_lm_head_scores_from_its_codes_and_rescores_the_top_exactly(rows: int, dtype: torch.dtype) -> None:
    head = _head(4096, 128, dtype)
    hidden = torch.randn(rows, 128).to(dtype)
    exact = hidden.float() @ head.weight.float().t()  # what the bf16 head's top candidates are rescored to
    assert quantize_head(_Model(head), Int8Method())
    assert head.int8 is not None and head.int8[0].dtype == torch.int8
    logits = head(hidden)
    assert logits is not None
    # the codes score every token: int8's rounding, about a step per row against the dequantized weight
    codes, scales = head.int8
    dequantized = hidden.float() @ (codes.float() * scales[:, None]).t()
    torch.testing.assert_close(logits, dequantized, rtol=0.02, atol=0.02)
    # each row's top candidates carry the exact float32 score of the kept weight: the argmax is the bf16 head's
    scores = cpu_gemm_portable.scores(hidden, codes, scales)
    assert scores is not None
    top = scores.topk(RESCORED_INT8_LOGITS, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert not torch.equal(logits, exact)  # (the rest are int8's: this is the int8 path)


def test_the_lm_head_keeps_its_weight_without_the_int8_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    head = _head(64, 64)
    assert not quantize_head(_Model(head), Fp8Method())  # another format: the head as it is
    monkeypatch.setattr(cpu_gemm, "has_int8", lambda: False)
    monkeypatch.setattr(cpu_gemm_portable, "load", lambda: None)
    assert not quantize_head(_Model(head), Int8Method())  # no C int8 kernel: no codes, nothing more held
    assert head.int8 is None


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason="the int8 LM head needs a C int8 kernel (a compiler)")
def test_weight_bytes_count_an_int8_head_s_codes_beside_its_weight() -> None:
    model = _Model(_head(64, 64))
    assert weight_bytes(model) == 64 * 64 * 2
    assert quantize_head(model, Int8Method())
    assert weight_bytes(model) == 64 * 64 * 2 + 64 * 64 + 64 * 4


class _Model(torch.nn.Module):
    def __init__(self, head: ParallelLMHead) -> None:
        super().__init__()
        self.lm_head = head


@pytest.mark.skipif(not cpu_gemm.has_int8(), reason="the fused gated product runs on the AMX-INT8 kernel only")
def test_an_int8_down_projection_takes_the_gated_activation_in_its_kernel() -> None:
    down = QuantLinear.quantized(Int8Method(), torch.randn(64, 128) * 0.05)
    down.role = "down_proj"
    down.cast(torch.bfloat16)
    gate_up = torch.randn(16, 256).bfloat16()
    fused = silu_gated_product(down, gate_up)
    gate, up = gate_up.split(128, dim=-1)
    assert fused is not None
    assert _relative_error(fused, down(F.silu(gate) * up).float()) < 0.01  # the unfused path: torch's two steps
    assert silu_gated_product(down, gate_up.float()) is None  # float32: not the kernel's
    prefill = torch.randn(200, 256).bfloat16()  # prefill's rows too
    gate, up = prefill.split(128, dim=-1)
    fused = silu_gated_product(down, prefill)
    assert fused is not None and _relative_error(fused, down(F.silu(gate) * up).float()) < 0.01
    down.register_forward_hook(lambda module, args, out: out)  # (what a LoRA adapter does)
    assert silu_gated_product(down, gate_up) is None  # the hook must see the call: the MLP calls down itself
    assert silu_gated_product(torch.nn.Linear(128, 64), gate_up) is None  # another weight: no fused path
