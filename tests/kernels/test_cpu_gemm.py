"""The AMX skinny-matmul kernel (kernels/cpu_gemm.py) against torch, and what it leaves to torch."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm
from kernels.cpu_features import cpu_flags_line

pytestmark = pytest.mark.unit

HAS_AMX = cpu_gemm.NEEDED_FLAGS <= set(cpu_flags_line().partition(":")[2].split())
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="the kernel needs AMX-BF16 (Sapphire Rapids or later)")


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


def test_no_amx_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "cpu_flags_line", lambda: "flags : avx512f avx512_bf16")
    cpu_gemm.load.cache_clear()
    try:
        assert cpu_gemm.load() is None
        x, w = torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16()
        assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))
    finally:
        cpu_gemm.load.cache_clear()
