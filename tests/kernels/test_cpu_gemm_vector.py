"""The matmul kernel of CPUs without AMX (kernels/csrc/vector_gemm_cpu.c), each build this CPU can run (AVX-512 BF16,
AVX2) against float64 products of the same numbers, and the choice of build (kernels/cpu_isa.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels import cpu_gemm, cpu_isa

pytestmark = pytest.mark.unit

BUILDS = [
    pytest.param(isa, marks=pytest.mark.skipif(not cpu_isa.has(isa), reason=f"this CPU lacks the {isa} flags"))
    for isa in cpu_gemm.VECTOR_BUILDS
]
FP8 = torch.float8_e4m3fn


def product(
    isa: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, f32: bool = False, threads: int = 2
) -> torch.Tensor:
    """The `isa` build's x @ w^T (times scales), bf16 out or float32 (`f32`); fails the test when it refuses."""
    library = cpu_gemm.load_vector(isa)
    assert library is not None, f"{isa}: the kernel must build where the CPU has the flags (gcc is in the set-up)"
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32 if f32 else torch.bfloat16)
    entry = library.skinny_gemm_f32 if f32 else library.skinny_gemm
    fmt = cpu_gemm.VECTOR_FORMATS[w.dtype]
    scale_pointer = None if scales is None else scales.data_ptr()
    status = entry(x.data_ptr(), w.data_ptr(), scale_pointer, out.data_ptr(), *x.shape[:1], *w.shape, fmt, threads)
    assert status == 0
    return out


def weights(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fmt == "bf16":
        return torch.randn(n, k, generator=gen).bfloat16(), None
    scales = torch.rand(n, generator=gen) / 64 + 1e-3
    if fmt == "int8":
        return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), scales
    return (torch.randn(n, k, generator=gen) * 40).to(FP8), scales


def reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The product in float64, and the sum of the products' magnitudes (what float32 summation errs against)."""
    wd = w.double() if scales is None else w.double() * scales.double()[:, None]
    return x.double() @ wd.t(), x.double().abs() @ wd.abs().t()


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 3, 7, 16, 64])
def test_every_format_matches_the_float64_product(isa: str, fmt: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w, scales = weights(fmt, 48, 96, gen)
    want, magnitude = reference(x, w, scales)
    got = product(isa, x, w, scales)
    err = (got.double() - want).abs()
    assert bool((err <= 2**-8 * want.abs() + 1e-5 * magnitude + 1e-30).all()), float(err.max())
    exact = product(isa, x, w, scales, f32=True)  # the float32 sums, not rounded to bf16's step
    assert bool(((exact.double() - want).abs() <= 1e-5 * magnitude + 1e-30).all())
    assert torch.equal(exact.bfloat16(), got), "bf16 out is the float32 sum rounded once"


@pytest.mark.parametrize("isa", BUILDS)
def test_every_fp8_code_is_widened_to_its_value(isa: str) -> None:
    """All 254 e4m3 codes that are numbers (subnormals, ±0 and the largest included), times identity rows: each
    output is one code's value, exactly."""
    codes = torch.arange(512, dtype=torch.int32).remainder(256).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
    w = codes.view(FP8).reshape(16, 32)
    x = torch.eye(32).bfloat16()
    got = product(isa, x, w, torch.ones(16), f32=True)
    assert torch.equal(got, w.float().t())


@pytest.mark.parametrize("isa", BUILDS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(isa: str) -> None:
    """Batch invariance: each row alone, bit for bit its result in a call of 64 rows (every block shape)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=gen).bfloat16()
    w, _ = weights("bf16", 32, 64, gen)
    together = product(isa, x, w, None, f32=True)
    for rows in (1, 2, 5, 13):
        for first in range(0, 64 - rows, 17):
            assert torch.equal(product(isa, x[first : first + rows], w, None, f32=True), together[first : first + rows])


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_every_stripe_is_multiplied_once_whatever_the_threads(isa: str, threads: int) -> None:
    """37 stripes of 32 channels (the last half wide) shared by more threads than cores: one thread's bits."""
    gen = torch.Generator().manual_seed(threads)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    w, scales = weights("int8", 37 * 32 - 16, 64, gen)
    alone = product(isa, x, w, scales, threads=1)
    for _ in range(5):
        assert torch.equal(product(isa, x, w, scales, threads=threads), alone)


@pytest.mark.parametrize("isa", BUILDS)
def test_shapes_it_cannot_take_are_refused(isa: str) -> None:
    library = cpu_gemm.load_vector(isa)
    assert library is not None
    x, out = torch.zeros(2, 64).bfloat16(), torch.empty(2, 64).bfloat16()
    w = torch.zeros(64, 64).bfloat16()
    call = ctypes.c_void_p
    for m, n, k, fmt in [(2, 40, 64, 0), (2, 64, 40, 0), (0, 64, 64, 0), (2, 64, 64, 3), (2, 64, 64, 1)]:
        args = (call(x.data_ptr()), call(w.data_ptr()), None, call(out.data_ptr()), m, n, k, fmt, 1)
        assert library.skinny_gemm(*args) == -1, (m, n, k, fmt)  # fmt 1 without scales too


SAPPHIRE_RAPIDS = "flags : avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8"
ZEN4 = "flags : avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
ZEN3 = "flags : avx2 fma f16c"


@pytest.mark.parametrize(
    ("line", "ceiling", "want"),
    [
        (SAPPHIRE_RAPIDS, "auto", "amx"),
        (SAPPHIRE_RAPIDS, "avx512_bf16", "avx512_bf16"),  # AMX switched off: the AVX-512 kernels tested there
        (SAPPHIRE_RAPIDS, "avx2", "avx2"),
        (ZEN4, "auto", "avx512_bf16"),
        (ZEN4, "amx", "avx512_bf16"),  # a ceiling: the best below it that the CPU has
        (ZEN3, "auto", "avx2"),
        (ZEN3, "avx512_bf16", "avx2"),
        ("flags : sse2 avx", "auto", None),
        ("flags : avx2", "auto", None),  # no FMA
    ],
)
def test_the_set_is_the_best_the_cpu_has_up_to_the_ceiling(line: str, ceiling: str, want: str | None) -> None:
    assert cpu_isa.best(ceiling, line) == want


def test_an_unknown_set_is_an_error() -> None:
    with pytest.raises(ValueError, match="cpu_isa"):
        cpu_isa.set_ceiling("avx9000")


@pytest.mark.skipif(not cpu_isa.has("avx2"), reason="this CPU lacks the avx2 flags")
def test_the_ceiling_picks_which_library_the_products_use() -> None:
    """--cpu-isa avx2 on any machine with AVX2: the AVX2 build serves `linear`, with its results."""
    gen = torch.Generator().manual_seed(1)
    x, (w, _) = torch.randn(3, 64, generator=gen).bfloat16(), weights("bf16", 32, 64, gen)
    before = cpu_isa._ceiling[0]
    try:
        cpu_isa.set_ceiling("avx2")
        assert cpu_isa.current() == "avx2" and cpu_gemm.load() is cpu_gemm.load_vector("avx2")
        assert torch.equal(cpu_gemm.linear(x, w), product("avx2", x, w, None))
        assert not cpu_gemm.has_int8(), "the activation-quantizing entries are AMX's"
    finally:
        cpu_isa.set_ceiling(before)
