"""The portable int8 weight-only kernel (kernels/cpu_gemm_int8.py) against float64, what it refuses, and its batch
invariance."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_gemm_int8
from worker_node.models.quant_int8 import quantize_rows

pytestmark = pytest.mark.unit

SHAPES = [(8, 16), (40, 96), (136, 208)]  # outputs, inputs: one block, several, a partial last stripe


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _weights(outputs: int, inputs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_rows(torch.randn(outputs, inputs, generator=gen) * 0.05)


def _assert_matches_float64(got: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Against the product of the same values in float64: float32 sums over the row, then (bf16) one rounding."""
    weight = codes.double() * scales.double()[:, None]
    want = x.double() @ weight.t()
    magnitude = x.double().abs() @ weight.abs().t()
    rounding = 2**-8 if x.dtype == torch.bfloat16 else 0.0
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.double() - want).abs()
    assert bool((err <= rounding * want.abs() + 1e-6 * magnitude + 1e-30).all()), float(err.max())


def test_the_kernel_builds_here() -> None:
    assert cpu_gemm_int8.load() is not None, "the portable kernel must build wherever gcc is (the set-up has it)"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 40, 64])
@pytest.mark.parametrize(("outputs", "inputs"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_matches_float64(rows: int, outputs: int, inputs: int, dtype: torch.dtype, threads: int) -> None:
    codes, scales = _weights(outputs, inputs, rows * 1000 + outputs)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = cpu_gemm_int8.linear(x, codes, scales)
    assert got is not None
    _assert_matches_float64(got, x, codes, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_s_result_does_not_depend_on_the_other_rows(dtype: torch.dtype, threads: int) -> None:
    codes, scales = _weights(136, 208, 7)
    batch = torch.randn(17, 208, generator=torch.Generator().manual_seed(3)).to(dtype)
    among = cpu_gemm_int8.linear(batch, codes, scales)
    assert among is not None
    for row in (0, 5, 16):
        alone = cpu_gemm_int8.linear(batch[row : row + 1], codes, scales)
        assert alone is not None and torch.equal(alone[0], among[row])
    in_six = cpu_gemm_int8.linear(batch[:6], codes, scales)  # another register block of the same rows
    assert in_six is not None and torch.equal(in_six, among[:6])


def test_sixteen_lanes_compute_the_same_product() -> None:
    """The vector width of AVX-512 builds (16 floats), here with its plain widening: the blocks' arithmetic."""
    library = cpu_gemm_int8.build((*cpu_gemm_int8.FLAGS, "-DLANES=16"))
    assert library is not None
    codes, scales = _weights(136, 208, 11)
    for rows in (1, 5, 17, 64):
        x = torch.randn(rows, 208, generator=torch.Generator().manual_seed(rows))
        got = cpu_gemm_int8.multiply(library, x, codes, scales)
        assert got is not None
        _assert_matches_float64(got, x, codes, scales)


def test_what_the_kernel_does_not_cover_is_left_to_the_caller() -> None:
    codes, scales = _weights(40, 96, 1)
    x = torch.randn(3, 96)
    assert cpu_gemm_int8.linear(x, codes, scales) is not None
    refused = {
        "rows past MAX_ROWS": (torch.randn(cpu_gemm_int8.MAX_ROWS + 1, 96), codes, scales),
        "no rows": (torch.randn(0, 96), codes, scales),
        "float16 activations": (x.half(), codes, scales),
        "a 3-d input": (x[None], codes, scales),
        "inputs not a multiple of 16": (x[:, :88].contiguous(), codes[:, :88].contiguous(), scales),
        "outputs not a multiple of 8": (x, codes[:36], scales[:36]),
        "codes not contiguous": (torch.randn(3, 40), codes.t(), scales[:40]),
        "bf16 scales": (x, codes, scales.bfloat16()),
        "scales of another width": (x, codes, scales[:32]),
        "widths that disagree": (torch.randn(3, 80), codes, scales),
    }
    for what, (xs, qs, ss) in refused.items():
        assert cpu_gemm_int8.linear(xs, qs, ss) is None, what


def test_no_kernel_when_the_cpu_kernels_are_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_gemm_int8.cpu_gemm.DISABLE_ENV, "0")
    cpu_gemm_int8.load.cache_clear()
    try:
        assert cpu_gemm_int8.linear(torch.randn(1, 96), *_weights(40, 96, 1)) is None
    finally:
        monkeypatch.undo()
        cpu_gemm_int8.load.cache_clear()
