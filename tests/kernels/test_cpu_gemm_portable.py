"""The portable weight-only kernels (kernels/cpu_gemm_portable.py), int8 per channel and AWQ int4 per group, against
float64, what they refuse, and their batch invariance."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_gemm_portable
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
    assert cpu_gemm_portable.load() is not None, "the portable kernel must build wherever gcc is (the set-up has it)"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 40, 64])
@pytest.mark.parametrize(("outputs", "inputs"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_matches_float64(rows: int, outputs: int, inputs: int, dtype: torch.dtype, threads: int) -> None:
    codes, scales = _weights(outputs, inputs, rows * 1000 + outputs)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = cpu_gemm_portable.linear(x, codes, scales)
    assert got is not None
    _assert_matches_float64(got, x, codes, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_s_result_does_not_depend_on_the_other_rows(dtype: torch.dtype, threads: int) -> None:
    codes, scales = _weights(136, 208, 7)
    batch = torch.randn(17, 208, generator=torch.Generator().manual_seed(3)).to(dtype)
    among = cpu_gemm_portable.linear(batch, codes, scales)
    assert among is not None
    for row in (0, 5, 16):
        alone = cpu_gemm_portable.linear(batch[row : row + 1], codes, scales)
        assert alone is not None and torch.equal(alone[0], among[row])
    in_six = cpu_gemm_portable.linear(batch[:6], codes, scales)  # another register block of the same rows
    assert in_six is not None and torch.equal(in_six, among[:6])


def test_sixteen_lanes_compute_the_same_product() -> None:
    """The vector width of AVX-512 builds (16 floats), here with its plain widening: the blocks' arithmetic."""
    library = cpu_gemm_portable.build((*cpu_gemm_portable.FLAGS, "-DLANES=16"))
    assert library is not None
    codes, scales = _weights(136, 208, 11)
    for rows in (1, 5, 17, 64):
        x = torch.randn(rows, 208, generator=torch.Generator().manual_seed(rows))
        got = cpu_gemm_portable.multiply(library, x, codes, scales)
        assert got is not None
        _assert_matches_float64(got, x, codes, scales)


def test_what_the_kernel_does_not_cover_is_left_to_the_caller() -> None:
    codes, scales = _weights(40, 96, 1)
    x = torch.randn(3, 96)
    assert cpu_gemm_portable.linear(x, codes, scales) is not None
    refused = {
        "rows past MAX_ROWS": (torch.randn(cpu_gemm_portable.MAX_ROWS + 1, 96), codes, scales),
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
        assert cpu_gemm_portable.linear(xs, qs, ss) is None, what


def test_no_kernel_when_the_cpu_kernels_are_switched_off() -> None:
    """A worker's --no-cpu-gemm (settings/fast_paths.py), set as it loads."""
    cpu_gemm_portable.cpu_gemm.set_enabled(False)
    try:
        assert cpu_gemm_portable.linear(torch.randn(1, 96), *_weights(40, 96, 1)) is None
    finally:
        cpu_gemm_portable.cpu_gemm.set_enabled(True)
    assert cpu_gemm_portable.load() is not None, "on again"


# ---- int4 (AWQ's codes, zero points and scales per group)

INT4_SHAPES = [(8, 32, 32), (40, 128, 64), (136, 256, 128), (24, 192, 32)]  # outputs, inputs, group


def _int4_weights(outputs: int, inputs: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """AWQ's tensors (codes [K, N], zero points and scales [K/G, N]) and the weight they make, float64 [N, K]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (inputs, outputs), generator=gen)
    zeros = torch.randint(0, 16, (inputs // group, outputs), generator=gen)
    scales = torch.rand(inputs // group, outputs, generator=gen) * 0.02 + 1e-3
    weight = ((codes - zeros.repeat_interleave(group, 0)).double() * scales.double().repeat_interleave(group, 0)).t()
    return codes, zeros, scales, weight


def _assert_int4_matches(got: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Against float64: float32 widening (one FMA per code) and sums, then (bf16) one rounding."""
    assert got is not None and got.dtype == x.dtype
    want = x.double() @ weight.t()
    magnitude = x.double().abs() @ weight.abs().t()
    rounding = 2**-8 if x.dtype == torch.bfloat16 else 0.0
    err = (got.double() - want).abs()
    assert bool((err <= rounding * want.abs() + 2e-6 * magnitude + 1e-30).all()), float(err.max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 64, 65, 130])
@pytest.mark.parametrize(("outputs", "inputs", "group"), INT4_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_product_matches_float64(
    rows: int, outputs: int, inputs: int, group: int, dtype: torch.dtype, threads: int
) -> None:
    codes, zeros, scales, weight = _int4_weights(outputs, inputs, group, rows + outputs)
    chunk = cpu_gemm_portable.int4_chunk()
    assert chunk is not None and cpu_gemm_portable.fits_int4(outputs, inputs, group)
    packed, pairs = cpu_gemm_portable.repack_int4(codes, zeros, scales, chunk)
    assert packed.shape == (outputs, inputs // 2) and pairs.shape == (outputs, inputs // group, 2)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).to(dtype)
    _assert_int4_matches(cpu_gemm_portable.linear_int4(x, packed, pairs), x, weight)


def test_an_int4_row_s_result_does_not_depend_on_the_other_rows(threads: int) -> None:
    codes, zeros, scales, _ = _int4_weights(136, 256, 64, 5)
    packed, pairs = cpu_gemm_portable.repack_int4(codes, zeros, scales, cpu_gemm_portable.int4_chunk() or 0)
    batch = torch.randn(70, 256, generator=torch.Generator().manual_seed(4))
    among = cpu_gemm_portable.linear_int4(batch, packed, pairs)
    assert among is not None
    for row in (0, 3, 66):  # a 4-row block, its remainder, the second 64-row chunk
        alone = cpu_gemm_portable.linear_int4(batch[row : row + 1], packed, pairs)
        assert alone is not None and torch.equal(alone[0], among[row])


def test_sixteen_lanes_make_the_same_int4_product() -> None:
    """AVX-512's vector width (plain widening here): its own layout (chunks of 32 inputs), the same numbers."""
    library = cpu_gemm_portable.build((*cpu_gemm_portable.FLAGS, "-DLANES=16"))
    chunk = cpu_gemm_portable.int4_chunk(library)
    assert library is not None and chunk == 32
    codes, zeros, scales, weight = _int4_weights(40, 128, 64, 9)
    packed, pairs = cpu_gemm_portable.repack_int4(codes, zeros, scales, chunk)
    for rows in (1, 6, 64):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        _assert_int4_matches(cpu_gemm_portable.linear_int4(x, packed, pairs, library), x, weight)
    # a group smaller than this build's chunk does not fit, and the C entry refuses it too
    assert not cpu_gemm_portable.fits_int4(40, 128, 16, library)


def test_what_the_int4_kernel_does_not_cover_is_left_to_the_caller() -> None:
    codes, zeros, scales, _ = _int4_weights(40, 128, 64, 2)
    packed, pairs = cpu_gemm_portable.repack_int4(codes, zeros, scales, cpu_gemm_portable.int4_chunk() or 0)
    x = torch.randn(3, 128)
    assert cpu_gemm_portable.linear_int4(x, packed, pairs) is not None
    refused = {
        "no rows": (torch.randn(0, 128), packed, pairs),
        "float16 activations": (x.half(), packed, pairs),
        "a 3-d input": (x[None], packed, pairs),
        "widths that disagree": (torch.randn(3, 96), packed, pairs),
        "codes not uint8": (x, packed.to(torch.int16), pairs),
        "codes not contiguous": (x, packed.t().contiguous().t(), pairs),
        "pairs of another width": (x, packed, pairs[:32]),
        "bf16 pairs": (x, packed, pairs.bfloat16()),
        "outputs not a multiple of 8": (x, packed[:36].contiguous(), pairs[:36].contiguous()),
    }
    for what, (xs, cs, ps) in refused.items():
        assert cpu_gemm_portable.linear_int4(xs, cs, ps) is None, what
    assert not cpu_gemm_portable.fits_int4(36, 128, 64) and not cpu_gemm_portable.fits_int4(40, 96, 64)


def test_the_widened_int4_weight_is_the_one_the_product_multiplies_by() -> None:
    """`widen_int4` (prefill's weight for torch's matmul) holds the kernel's numbers: the product of the identity."""
    codes, zeros, scales, weight = _int4_weights(40, 128, 32, 8)
    packed, pairs = cpu_gemm_portable.repack_int4(codes, zeros, scales, cpu_gemm_portable.int4_chunk() or 0)
    wide = cpu_gemm_portable.widen_int4(packed, pairs)
    assert wide is not None and wide.shape == (40, 128) and wide.dtype == torch.float32
    through = cpu_gemm_portable.linear_int4(torch.eye(128), packed, pairs)
    assert through is not None and torch.equal(wide.t(), through)
    torch.testing.assert_close(wide.double(), weight, rtol=1e-6, atol=1e-7)
    assert cpu_gemm_portable.widen_int4(packed.t(), pairs) is None  # not the layout
    assert cpu_gemm_portable.widen_int4(packed, pairs[:, :3].contiguous()) is None  # 3 groups do not split 128
