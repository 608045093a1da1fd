"""The AWQ int4 kernel (kernels/cpu_gemm_awq.py) against the dequantized weights, its layout's round trip, and what
it leaves to torch."""

import pytest
import torch

from kernels import cpu_gemm, cpu_gemm_awq
from kernels.cpu_features import cpu_flags_line

pytestmark = pytest.mark.unit

HAS_AMX = cpu_gemm.NEEDED_FLAGS <= set(cpu_flags_line().partition(":")[2].split())
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="the kernel needs AMX-BF16 (Sapphire Rapids or later)")


def _awq(outputs: int, inputs: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random AWQ tensors: codes [K, N] and zeros [K/G, N] covering 0..15, float16-valued scales [K/G, N]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (inputs, outputs), generator=gen)
    codes.view(-1)[:16] = torch.arange(16)
    zeros = torch.randint(0, 16, (inputs // group, outputs), generator=gen)
    scales = (torch.rand(inputs // group, outputs, generator=gen) / 32 + 1e-3).half().float()
    return codes, zeros, scales


def _weight(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group = codes.shape[0] // zeros.shape[0]
    return ((codes - zeros.repeat_interleave(group, 0)).float() * scales.repeat_interleave(group, 0)).t()


def test_the_layout_reads_back_to_the_awq_tensors() -> None:
    codes, zeros, scales = _awq(48, 192, 64, seed=1)
    packed, block_scales = cpu_gemm_awq.repack(codes, zeros, scales)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 48, 32)  # a quarter of bf16's bytes
    assert block_scales.shape == (3, 3, 2, 16)
    back = cpu_gemm_awq.awq_tensors(packed, block_scales)
    for got, want in zip(back, (codes, zeros, scales)):
        assert torch.equal(got, want.to(got.dtype))


@needs_amx
def test_the_kernel_builds_where_the_cpu_has_amx() -> None:
    assert cpu_gemm_awq.load() is not None, "the C kernel must build on AMX machines (gcc is in the set-up)"


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 12, 16, 17, 64, 70])  # dots to 2, tiles (sums in registers), slices
@pytest.mark.parametrize(("outputs", "inputs", "group"), [(16, 32, 32), (48, 192, 64), (80, 256, 128)])
def test_the_kernel_multiplies_by_the_dequantized_weights(rows: int, outputs: int, inputs: int, group: int) -> None:
    """Against the same bf16 activations times the exact weights in float64: the kernel rounds each weight to
    bf16 nowhere (codes are exact, scales apply in float32), sums in float32 and rounds the output to bf16 once."""
    codes, zeros, scales = _awq(outputs, inputs, group, seed=rows * 1000 + outputs)
    w = _weight(codes, zeros, scales)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_gemm_awq.linear(x, *cpu_gemm_awq.repack(codes, zeros, scales))
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    want = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    err = (got.double() - want).abs()
    assert bool((err <= 2**-8 * want.abs() + 1e-5 * magnitude + 1e-30).all()), float(err.max())


def test_what_the_kernel_does_not_cover_is_left_to_torch() -> None:
    codes, zeros, scales = _awq(48, 192, 64, seed=2)
    packed, block_scales = cpu_gemm_awq.repack(codes, zeros, scales)
    assert cpu_gemm_awq.linear(torch.randn(2, 192), packed, block_scales) is None  # float32 activations
    assert cpu_gemm_awq.linear(torch.randn(2, 96).bfloat16(), packed, block_scales) is None  # the wrong width
    assert not cpu_gemm_awq.fits(40, 192, 64) and not cpu_gemm_awq.fits(48, 200, 40)
    assert cpu_gemm_awq.fits(48, 192, 64)


@needs_amx
@pytest.mark.parametrize("rows", [1, 16])
def test_every_block_is_multiplied_once_whatever_the_threads(rows: int) -> None:
    """Pairs of 16-channel blocks shared in runs, taken from each other's back (kernels/csrc/stripes.h): with more
    threads than cores the outputs are one thread's, bit for bit (37 blocks: the last pair is one block)."""
    codes, zeros, scales = _awq(37 * 16, 128, 64, seed=rows)
    packed = cpu_gemm_awq.repack(codes, zeros, scales)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_gemm_awq.linear(x, *packed)
        torch.set_num_threads(5)
        for _ in range(20):
            got = cpu_gemm_awq.linear(x, *packed)
            assert got is not None and alone is not None and torch.equal(got, alone)
    finally:
        torch.set_num_threads(before)
