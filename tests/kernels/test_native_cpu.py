"""The compiled CPU decode kernel against dense attention, and what it hands back to the torch path."""

import pytest
import torch

from kernels import cpu_attention, native_build, torch_attention
from tests.support.paged_inputs import dense_causal_attention, make_paged_batch, rel_err

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def native() -> cpu_attention.NativeDecodeAttention:
    assert cpu_attention.load() is not None, "the C kernel must build on the test machines (gcc is in the set-up)"
    return cpu_attention.NativeDecodeAttention(torch_attention.paged_decode_attention)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 32), (32, 64), (8, 128)])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8), (3, 3)])
def test_decode_matches_dense(
    native: cpu_attention.NativeDecodeAttention,
    block_size: int,
    head_dim: int,
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(block_size + head_dim + 7 * group + num_kv_heads)
    lens = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 2]
    batch = make_paged_batch(lens, lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = (torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen) * 3).to(dtype)  # peaked too
    out = native(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5)
    assert out.dtype == dtype
    # The oracle sees the same bf16 values in float64: the kernel's only loss is float32 arithmetic, plus the
    # rounding of its output to bf16.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for i, n in enumerate(lens):
        want = dense_causal_attention(q[i : i + 1], batch.keys[i], batch.values[i], head_dim**-0.5, n - 1)
        assert rel_err(out[i : i + 1], want) < tol, f"sequence {i} of length {n}"


def test_bf16_cache_is_read_in_float32(native: cpu_attention.NativeDecodeAttention) -> None:
    """float32 queries over a bf16 cache: no rounding anywhere but the cache's own, so float32 accuracy."""
    gen = torch.Generator().manual_seed(11)
    lens = [3, 40, 17]
    batch = make_paged_batch(lens, lens, 3, 64, 16, torch.bfloat16, gen)
    q = torch.randn(len(lens), 9, 64, generator=gen) * 3
    out = native(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    assert out.dtype == torch.float32
    for i, n in enumerate(lens):
        want = dense_causal_attention(q[i : i + 1], batch.keys[i], batch.values[i], 0.125, n - 1)
        assert rel_err(out[i : i + 1], want) < 1e-5, f"sequence {i} of length {n}"


def test_bf16_queries_in_and_out_are_the_float32_path_rounded_once(native: cpu_attention.NativeDecodeAttention) -> None:
    """bf16 queries go into the kernel as they are and it rounds its own output (to nearest even): what widening
    them in torch and rounding the float32 output there gives, but for float32 rounding inside (over a bf16 cache
    with AVX-512 BF16 the scores are dot products of the stored bits, scaled after: a float32 rounding apart from
    the widened path's); the same bits with the step's plan or without."""
    gen = torch.Generator().manual_seed(13)
    lens = [1, 3, 40, 17, 33]
    batch = make_paged_batch(lens, lens, 3, 64, 16, torch.bfloat16, gen)
    q = (torch.randn(len(lens), 9, 64, generator=gen) * 3).bfloat16()
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    widened = native(q.float(), *args)
    plan = cpu_attention.plan_decode(batch.block_tables, batch.seq_lens, 16)
    out = native(q, *args)
    assert out.dtype == torch.bfloat16 and torch.equal(out, native(q, *args, plan=plan))
    step = widened.abs() * 2**-8  # one bf16 rounding of the output
    assert bool(((out.float() - widened).abs() <= step + 1e-6).all())
    assert float((out.float() - widened.bfloat16().float()).abs().max()) <= float(step.max())


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (21, 0.0), (16, 0.0), (0, 2.0), (21, 2.0)])
def test_window_and_softcap_match_dense(
    native: cpu_attention.NativeDecodeAttention, window: int, softcap: float
) -> None:
    """A window starting mid-block, on a block boundary (16), past the shorter sequences; soft-capped scores."""
    gen = torch.Generator().manual_seed(window)
    lens = [1, 5, 6, 16, 17, 21, 22, 70]
    batch = make_paged_batch(lens, lens, 2, 32, 16, torch.float32, gen)
    q = torch.randn(len(lens), 6, 32, generator=gen) * 3  # scores large enough to be capped
    out = native(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.3, window=window, softcap=softcap
    )
    for i, n in enumerate(lens):
        want = dense_causal_attention(q[i : i + 1], batch.keys[i], batch.values[i], 0.3, n - 1, window, softcap)
        assert rel_err(out[i : i + 1], want) < 1e-5, f"sequence {i} of length {n}"


def test_uncovered_inputs_go_to_the_fallback(native: cpu_attention.NativeDecodeAttention) -> None:
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([5, 20], [5, 20], 2, 16, 16, torch.float64, gen)
    q = torch.randn(2, 4, 16, generator=gen, dtype=torch.float64)
    calls: list[torch.Tensor] = []

    def torch_path(q: torch.Tensor, *args: object, **options: object) -> torch.Tensor:
        calls.append(q)
        return q

    fallback = cpu_attention.NativeDecodeAttention(torch_path)
    fallback(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.25)
    assert len(calls) == 1, "a float64 cache is not the kernel's: the torch path must take it"
    fallback(q.float(), batch.k_cache.half(), batch.v_cache.half(), batch.block_tables, batch.seq_lens, 0.25)
    assert len(calls) == 2, "neither is float16"
    too_wide = torch.randn(2, 2 * 17, 16)  # 17 query heads per kv head: more than the kernel is built for
    fallback(too_wide, batch.k_cache.float(), batch.v_cache.float(), batch.block_tables, batch.seq_lens, 0.25)
    assert len(calls) == 3


def test_build_is_cached_per_source_shape_and_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    cpu_attention.load.cache_clear()
    assert cpu_attention.load(32, 2) is not None
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_attention.load.cache_clear()
    assert cpu_attention.load(32, 2) is not None
    assert built[0].stat().st_mtime_ns == stamp, "a second load must reuse the built library"
    assert cpu_attention.load(32, 4) is not None
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2, "another head shape is another build"
    assert cpu_attention.load(32, 4, torch.bfloat16) is not None
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 3, "a bf16 cache is another build"
    cpu_attention.load.cache_clear()


def test_no_compiler_means_no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    cpu_attention.load.cache_clear()
    assert cpu_attention.load() is None
    cpu_attention.load.cache_clear()


def test_loading_keeps_the_process_floating_point_mode(native: cpu_attention.NativeDecodeAttention) -> None:
    # A library linked with -ffast-math would flush subnormals to zero in every thread of the worker.
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert float(tiny * 1.0) != 0.0
    assert float(torch.tensor(1e-310, dtype=torch.float64) * 1.0) != 0.0
