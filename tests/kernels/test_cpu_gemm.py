"""The AMX skinny-matmul kernel (kernels/cpu_gemm.py) against torch, and what it leaves to torch (the kernel of CPUs
without AMX: tests/kernels/test_cpu_gemm_vector.py)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_isa
from kernels.cpu_features import cpu_flags_line

pytestmark = pytest.mark.unit

HAS_AMX = cpu_gemm.NEEDED_FLAGS <= set(cpu_flags_line().partition(":")[2].split())
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="the kernel needs AMX-BF16 (Sapphire Rapids or later)")
HAS_AMX_INT8 = HAS_AMX and cpu_gemm.INT8_FLAG in cpu_flags_line().partition(":")[2].split()
needs_amx_int8 = pytest.mark.skipif(not HAS_AMX_INT8, reason="the int8 kernel needs AMX-INT8")


def _assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """Against the product of the same bf16/int8 values in float64: the kernel sums in float32 and rounds its
    output to bf16 once, so the error is bf16's half step plus float32 summation over the row."""
    want = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    if scales is not None:
        want, magnitude = want * scales.double(), magnitude * scales.double()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).abs()
    assert bool((err <= 2**-8 * want.abs() + 1e-5 * magnitude + 1e-30).all()), float(err.max())


@needs_amx
def test_the_kernel_builds_where_the_cpu_has_amx() -> None:
    assert cpu_gemm.load() is not None, "the C kernel must build on AMX machines (gcc is in the set-up)"


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 64])
@pytest.mark.parametrize(("outputs", "inputs"), [(16, 32), (48, 96), (80, 224)])
def test_bf16_weights_match_torch(rows: int, outputs: int, inputs: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + outputs + inputs)
    x = torch.randn(rows, inputs, generator=gen).bfloat16()
    w = torch.randn(outputs, inputs, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    assert cpu_gemm.covers(x, w)
    _assert_close(cpu_gemm.linear(x, w), x, w)
    with_bias = cpu_gemm.linear(x, w, bias)
    assert torch.equal(with_bias, cpu_gemm.linear(x, w) + bias)


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 64, 150])
def test_float32_scores_are_the_unrounded_sums(rows: int) -> None:
    """An LM head's logits (`scores`): float32 sums of the bf16 products, not rounded to bf16's step (which
    the bf16 product's results are), any rows (past 64, in calls of 64)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(80, 96, generator=gen).bfloat16()
    got = cpu_gemm.scores(x, w)
    assert got is not None and got.dtype == torch.float32 and got.shape == (rows, 80)
    want = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    assert bool(((got.double() - want).abs() <= 1e-5 * magnitude + 1e-30).all())
    rounded = cpu_gemm.linear(x, w)
    assert torch.equal(got.bfloat16(), rounded)  # the same sums, rounded once
    assert not torch.equal(got, rounded.float())


@needs_amx
def test_float32_scores_refuse_what_the_kernel_does_not_take() -> None:
    x = torch.randn(4, 96).bfloat16()
    assert cpu_gemm.scores(x.float(), torch.randn(80, 96)) is None
    assert cpu_gemm.scores(x, torch.randn(80, 96).bfloat16()[:, :64]) is None  # widths differ
    assert cpu_gemm.scores(x, torch.randint(-9, 9, (80, 96), dtype=torch.int8)) is None  # codes: linear_int8_act
    assert cpu_gemm.scores(torch.randn(4, 100).bfloat16(), torch.randn(80, 100).bfloat16()) is None  # K % 32


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64])
@pytest.mark.parametrize(("outputs", "inputs"), [(16, 64), (48, 96), (112, 160)])
def test_int8_weights_match_torch(rows: int, outputs: int, inputs: int) -> None:
    """Every code from -127 to 127 (the widening is a table lookup), per-channel scales."""
    gen = torch.Generator().manual_seed(rows * 1000 + outputs + inputs)
    x = torch.randn(rows, inputs, generator=gen).bfloat16()
    codes = torch.randint(-127, 128, (outputs, inputs), generator=gen, dtype=torch.int8)
    codes.view(-1)[:255] = torch.arange(-127, 128, dtype=torch.int8)[: codes.numel()]
    scales = torch.rand(outputs, generator=gen) / 64
    got = cpu_gemm.linear_int8(x, codes, scales)
    assert got is not None
    _assert_close(got, x, codes, scales)


def _int8_act_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """What the kernel computes, in float64: x quantized per row (absmax / qmax, to nearest) times the codes."""
    qmax = 127 if bits == 8 else 127 * 256 + 127
    xd = x.double()
    step = xd.abs().amax(dim=1, keepdim=True) / qmax
    qx = torch.where(step > 0, torch.round(xd / step.clamp_min(1e-300)), torch.zeros_like(xd))
    return (qx * step) @ codes.double().t() * scales.double()


@needs_amx_int8
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 5, 17, 64, 100])
@pytest.mark.parametrize(("outputs", "inputs"), [(16, 64), (48, 192), (112, 128)])
def test_int8_codes_times_quantized_activations_match_the_reference(
    bits: int, rows: int, outputs: int, inputs: int
) -> None:
    """Per-row activation codes, the 16-bit ones split into int8 halves; rows past 64 and partial row groups and
    stripes; a zero row (scale 0) gives zeros. float32 outputs (an LM head's) are the sums the bf16 ones round."""
    gen = torch.Generator().manual_seed(rows * 1000 + outputs + inputs + bits)
    x = torch.randn(rows, inputs, generator=gen).bfloat16()
    x[rows // 2] = 0
    codes = torch.randint(-127, 128, (outputs, inputs), generator=gen, dtype=torch.int8)
    scales = torch.rand(outputs, generator=gen) / 64
    got = cpu_gemm.linear_int8_act(x, codes, scales, bits)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    want = _int8_act_reference(x, codes, scales, bits)
    # bf16's half step on the output; a tie rounded the other way moves a code by one (x's step x |w|)
    step = x.double().abs().amax(dim=1, keepdim=True) / (127 if bits == 8 else 32639)
    slack = step * codes.double().abs().amax(dim=1) * scales.double() * 2
    assert bool(((got.double() - want).abs() <= 2**-8 * want.abs() + slack + 1e-30).all())
    assert bool((got[rows // 2] == 0).all())
    sums = cpu_gemm.linear_int8_act(x, codes, scales, bits, out_dtype=torch.float32)
    assert sums is not None and sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), got)


@needs_amx_int8
def test_16_bit_activations_are_as_fine_as_bf16() -> None:
    """Against the unquantized product: the 16-bit codes add about 2^-15 of a row's largest input, so even an
    outlier channel 100x the others leaves the result within bf16's rounding; 8 bits do not."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 576, generator=gen)
    x[:, 7] = 300.0  # an outlier channel
    x = x.bfloat16()
    codes = torch.randint(-127, 128, (64, 576), generator=gen, dtype=torch.int8)
    codes[:, 7] = 0  # so the outlier sets the scale but not the result
    scales = torch.full((64,), 1e-3)
    exact = x.double() @ codes.double().t() * scales.double()
    errors = {}
    for bits in (8, 16):
        got = cpu_gemm.linear_int8_act(x, codes, scales, bits)
        assert got is not None
        errors[bits] = float((got.double() - exact).norm() / exact.norm())
    assert errors[16] < 4e-3 < errors[8], errors


@needs_amx_int8
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 17, 64, 100])
def test_a_gated_mlp_s_activation_is_made_in_the_int8_kernel(bits: int, rows: int) -> None:
    """silu(gate) * up of [gate | up] rows, made in float32 as each row is quantized: the product of those
    values quantized as the plain kernel quantizes a row, zero rows (an all-zero up) giving zeros."""
    gen = torch.Generator().manual_seed(rows * 10 + bits)
    gate_up = (torch.randn(rows, 2 * 192, generator=gen) * 3).bfloat16()  # silu's tails: e^-x from -9 to 9
    gate_up[rows // 2, 192:] = 0
    codes = torch.randint(-127, 128, (48, 192), generator=gen, dtype=torch.int8)
    scales = torch.rand(48, generator=gen) / 64
    got = cpu_gemm.linear_int8_act(gate_up, codes, scales, bits, silu_gated=True)
    assert got is not None and got.shape == (rows, 48)
    gate, up = gate_up.double().split(192, dim=-1)
    x = F.silu(gate) * up  # float64: the kernel's float32 exp is within 1e-7 of it
    want = _int8_act_reference(x, codes, scales, bits)
    step = x.abs().amax(dim=1, keepdim=True) / (127 if bits == 8 else 32639)
    slack = step * codes.double().abs().amax(dim=1) * scales.double() * 2
    assert bool(((got.double() - want).abs() <= 2**-8 * want.abs() + slack + 1e-30).all())
    assert bool((got[rows // 2] == 0).all())
    plain = torch.randn(rows, 192).bfloat16()  # the inputs' width must be twice the codes'
    assert cpu_gemm.linear_int8_act(plain, codes, scales, bits, silu_gated=True) is None


def test_what_the_int8_kernel_does_not_cover_is_refused() -> None:
    codes, scales = torch.ones(32, 96, dtype=torch.int8), torch.ones(32)
    assert cpu_gemm.linear_int8_act(torch.randn(4, 96).bfloat16(), codes, scales) is None  # 96 inputs: not 64s
    assert cpu_gemm.linear_int8_act(torch.randn(4, 96), codes, scales) is None  # float32 activations
    with pytest.raises(ValueError, match="act_bits"):
        cpu_gemm.linear_int8_act(torch.randn(4, 64).bfloat16(), torch.ones(32, 64, dtype=torch.int8), scales, 4)


def test_no_amx_int8_means_the_weight_only_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "cpu_flags_line", lambda: "flags : amx_tile amx_bf16 avx512_bf16")
    cpu_gemm._has_int8.cache_clear()
    try:
        codes, scales = torch.ones(32, 64, dtype=torch.int8), torch.ones(32)
        assert cpu_gemm.linear_int8_act(torch.randn(4, 64).bfloat16(), codes, scales) is None
    finally:
        cpu_gemm._has_int8.cache_clear()


@needs_amx
def test_a_strided_input_is_made_contiguous() -> None:
    x = torch.randn(64, 8).bfloat16().t()  # [8, 64], not contiguous
    w = torch.randn(32, 64).bfloat16()
    _assert_close(cpu_gemm.linear(x, w), x, w)


@pytest.mark.parametrize(
    ("x", "w"),
    [
        (torch.randn(4, 40).bfloat16(), torch.randn(32, 40).bfloat16()),  # inputs not a multiple of 32
        (torch.randn(4, 64).bfloat16(), torch.randn(20, 64).bfloat16()),  # outputs not a multiple of 16
        (torch.randn(65, 64).bfloat16(), torch.randn(32, 64).bfloat16()),  # more rows than the kernel's 64
        (torch.randn(4, 64), torch.randn(32, 64)),  # float32
        (torch.randn(2, 4, 64).bfloat16(), torch.randn(32, 64).bfloat16()),  # not a matrix
        (torch.randn(4, 64).bfloat16(), torch.randn(64, 32).bfloat16().t()),  # weight not contiguous
    ],
)
def test_what_the_kernel_does_not_cover_is_torchs(x: torch.Tensor, w: torch.Tensor) -> None:
    assert not cpu_gemm.covers(x, w)
    assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))
    if w.dtype == torch.bfloat16 and w.is_contiguous():  # the same shapes in int8 codes
        codes = torch.ones(w.shape, dtype=torch.int8)
        assert cpu_gemm.linear_int8(x, codes, torch.ones(w.shape[0])) is None


def test_no_amx_avx512_or_avx2_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags_line", lambda: "flags : sse2 avx avx512f")
    cpu_isa._chosen.cache_clear()
    try:
        assert cpu_isa.current() is None and cpu_gemm.load() is None
        x, w = torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16()
        assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))
    finally:
        cpu_isa._chosen.cache_clear()


@needs_amx_int8
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_every_stripe_is_multiplied_once_whatever_the_threads(threads: int) -> None:
    """The threads share the stripes of 32 channels in runs and take from each other's back (kernels/csrc/stripes.h):
    with more threads than cores, some descheduled mid-call, every channel is still computed once, in the same
    order: the outputs are one thread's, bit for bit (bf16 and int8 weights; 37 stripes, the last half wide). With
    fewer row groups than threads the int8 kernel's threads quantize slices of each row's inputs: the same codes."""
    gen = torch.Generator().manual_seed(threads)
    x = torch.randn(16, 128, generator=gen).bfloat16()
    gate_up = (torch.randn(16, 256, generator=gen) * 3).bfloat16()
    w = torch.randn(37 * 32 - 16, 128, generator=gen).bfloat16()
    codes = torch.randint(-127, 128, tuple(w.shape), generator=gen, dtype=torch.int8)
    scales = torch.rand(w.shape[0], generator=gen) / 64
    products = {
        "bf16": lambda: cpu_gemm.linear(x, w),
        "int8 widened": lambda: cpu_gemm.linear_int8(x, codes, scales),
        "int8 a16": lambda: cpu_gemm.linear_int8_act(x, codes, scales, 16),
        "int8 a16 gated": lambda: cpu_gemm.linear_int8_act(gate_up, codes, scales, 16, silu_gated=True),
        "int8 a8, 3 rows": lambda: cpu_gemm.linear_int8_act(x[:3], codes, scales, 8),
    }
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {name: run() for name, run in products.items()}
        torch.set_num_threads(threads)
        for _ in range(20):
            for name, run in products.items():
                got, want = run(), alone[name]
                assert got is not None and want is not None and torch.equal(got, want), name
    finally:
        torch.set_num_threads(before)
