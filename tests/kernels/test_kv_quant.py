"""The quantized KV cache formats (int8, fp8 e4m3, kernels/kv_quant.py) through the torch reference and the C CPU
decode kernel, each against float64 attention over the dequantized cache (tests/support/paged_inputs.py)."""

import pytest
import torch

from kernels import cpu_attention, torch_attention
from kernels.kv_quant import FLOAT_FORMATS, FORMATS, QMAX, cache_dtype, dequantize, quantize
from settings.worker import KV_CACHE_DTYPES
from tests.support.paged_inputs import dense_causal_attention, make_paged_batch, quantize_batch, rel_err

pytestmark = pytest.mark.unit

DTYPES = list(FORMATS.values())
EXACT = 1e-5  # float32 arithmetic over the same (dequantized) values: no other loss


def test_the_flag_names_every_format() -> None:
    assert set(KV_CACHE_DTYPES) == {"auto", *FORMATS, *FLOAT_FORMATS}
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("int8", torch.bfloat16) == torch.int8
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be auto or one of int8, fp8_e4m3, float16, bfloat16, float32, got 'int4'"
    ):
        cache_dtype("int4", torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantization_error_is_bounded_per_row(dtype: torch.dtype) -> None:
    """int8: at most half a step (scale / 2) per element; e4m3: 3 mantissa bits, so at most 1/16 of the element
    (or half of its smallest subnormal step, 2^-10 scales); each row's largest element maps to QMAX."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]  # rows of every size
    values, scales = quantize(x, dtype)
    assert values.dtype == dtype and scales.shape == (64, 3) and scales.dtype == torch.float32
    error = (dequantize(values, scales) - x).abs()
    if dtype == torch.int8:
        assert (error <= scales[..., None] / 2 * (1 + 1e-5)).all()
    else:
        assert (error <= torch.maximum(x.abs() / 16, scales[..., None] * 2**-10) * (1 + 1e-5)).all()
    assert torch.equal(values.float().abs().amax(-1), torch.full((64, 3), QMAX[dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_zero_row_reads_back_as_zeros(dtype: torch.dtype) -> None:
    values, scales = quantize(torch.zeros(2, 4, 16), dtype)
    assert (scales > 0).all(), "no division by zero"
    assert torch.equal(dequantize(values, scales), torch.zeros(2, 4, 16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_quantizes_each_token_into_its_slot(dtype: torch.dtype) -> None:
    """Tokens written over several steps (a prefill chunk, then one decode token at a time) each keep their own
    scale: what a sequence reads back is exactly each token quantized on its own."""
    gen = torch.Generator().manual_seed(7)
    lens = [3, 16, 21]
    batch = make_paged_batch(lens, [0, 0, 0], 2, 32, 16, torch.float32, gen)
    k_cache, v_cache = torch.zeros_like(batch.k_cache, dtype=dtype), torch.zeros_like(batch.v_cache, dtype=dtype)
    k_scales, v_scales = torch.zeros(k_cache.shape[:3]), torch.zeros(v_cache.shape[:3])
    for i, n in enumerate(lens):
        for lo, hi in ((0, n - 2), (n - 2, n - 1), (n - 1, n)):  # a chunk, then two single tokens
            keys, values = batch.keys[i][lo:hi] * (i + 1) * 10 ** (hi - n), batch.values[i][lo:hi]
            torch_attention.write_kv(
                keys, values, k_cache, v_cache, batch.slots(i, range(lo, hi)), k_scales=k_scales, v_scales=v_scales
            )
            batch.keys[i][lo:hi] = keys
    for i, n in enumerate(lens):
        table = batch.block_tables[i]
        for cache, scales, rows in ((k_cache, k_scales, batch.keys[i]), (v_cache, v_scales, batch.values[i])):
            assert torch.equal(torch_attention.gather_kv(cache, table, n, scales), dequantize(*quantize(rows, dtype)))


def test_write_kv_needs_the_scales_of_a_quantized_cache() -> None:
    cache = torch.zeros(2, 16, 1, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="torch.int8 KV cache is quantized: write_kv needs its scales"):
        torch_attention.write_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), cache, cache.clone(), torch.tensor([3]))


# (window, softcap): none, a window inside one block, one across blocks with a soft-cap
OPTIONS = [(0, 0.0), (5, 0.0), (21, 2.0)]


def _decode_case(dtype: torch.dtype, seed: int, num_kv_heads: int, group: int, head_dim: int, block_size: int):  # type: ignore[no-untyped-def]
    """A decode batch over a quantized cache: (queries, the quantized batch, block tables, seq lens)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1, block_size - 1, block_size, block_size + 1, 4 * block_size + 6]
    batch = make_paged_batch(lens, lens, num_kv_heads, head_dim, block_size, torch.float32, gen)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen) * 3  # scores large enough to cap
    return q, quantize_batch(batch, lens, dtype), batch.block_tables, batch.seq_lens


def _assert_decode_exact(
    out: torch.Tensor, q: torch.Tensor, qb, seq_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0
) -> None:  # type: ignore[no-untyped-def]  # noqa: E501
    for i, n in enumerate(seq_lens.tolist()):
        want = dense_causal_attention(q[i : i + 1], qb.keys[i], qb.values[i], scale, n - 1, window, softcap)
        assert rel_err(out[i : i + 1], want) < EXACT, f"sequence {i} of length {n}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), OPTIONS)
def test_torch_decode_matches_float64(dtype: torch.dtype, window: int, softcap: float) -> None:
    q, qb, tables, seq_lens = _decode_case(dtype, window, 2, 2, 32, 16)
    out = torch_attention.paged_decode_attention(
        q, qb.k_cache, qb.v_cache, tables, seq_lens, 0.3, window=window, softcap=softcap, **qb.scales()
    )
    _assert_decode_exact(out, q, qb, seq_lens, 0.3, window, softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), OPTIONS)
def test_torch_prefill_matches_float64(dtype: torch.dtype, window: int, softcap: float) -> None:
    """The cached prefix is read quantized; the new tokens attend to each other at full precision."""
    gen = torch.Generator().manual_seed(window + 1)
    pairs = [(0, 5), (10, 7), (16, 16), (33, 1), (5, 40)]  # (cached prefix, new tokens)
    lens, cached = [p + n for p, n in pairs], [p for p, _ in pairs]
    batch = make_paged_batch(lens, cached, 2, 32, 16, torch.float32, gen)
    qb = quantize_batch(batch, cached, dtype)
    q = torch.randn(sum(n for _, n in pairs), 4, 32, generator=gen) * 3
    k = torch.cat([batch.keys[i][p:] for i, p in enumerate(cached)])
    v = torch.cat([batch.values[i][p:] for i, p in enumerate(cached)])
    cu = torch.tensor([0] + [n for _, n in pairs]).cumsum(0).int()
    out = torch_attention.paged_prefill_attention(
        q, k, v, qb.k_cache, qb.v_cache, batch.block_tables, cu, batch.seq_lens, 0.3, window=window,
        softcap=softcap, **qb.scales(),
    )  # fmt: skip
    for i, p in enumerate(cached):
        lo, hi = int(cu[i]), int(cu[i + 1])
        want = dense_causal_attention(q[lo:hi], qb.keys[i], qb.values[i], 0.3, p, window, softcap)
        assert rel_err(out[lo:hi], want) < EXACT, f"sequence {i} with prefix {p}"


@pytest.fixture(scope="module")
def native() -> cpu_attention.NativeDecodeAttention:
    assert cpu_attention.load() is not None, "the C kernel must build on the test machines (gcc is in the set-up)"
    return cpu_attention.NativeDecodeAttention(torch_attention.paged_decode_attention)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "head_dim", "num_kv_heads", "group"), [(16, 32, 2, 1), (32, 64, 3, 3), (8, 128, 1, 8)]
)  # noqa: E501
def test_native_decode_matches_float64(
    native: cpu_attention.NativeDecodeAttention, dtype: torch.dtype, block_size: int, head_dim: int,
    num_kv_heads: int, group: int,
) -> None:  # fmt: skip
    q, qb, tables, seq_lens = _decode_case(dtype, block_size + group, num_kv_heads, group, head_dim, block_size)
    fallback = cpu_attention.NativeDecodeAttention(lambda *args, **options: pytest.fail("the kernel must run"))
    assert fallback.library(q, qb.k_cache, qb.v_cache, (qb.k_scales, qb.v_scales)) is not None
    out = native(q, qb.k_cache, qb.v_cache, tables, seq_lens, head_dim**-0.5, **qb.scales())
    _assert_decode_exact(out, q, qb, seq_lens, head_dim**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), OPTIONS[1:])
def test_native_decode_with_window_and_softcap(
    native: cpu_attention.NativeDecodeAttention, dtype: torch.dtype, window: int, softcap: float
) -> None:
    q, qb, tables, seq_lens = _decode_case(dtype, window, 2, 1, 32, 16)
    out = native(q, qb.k_cache, qb.v_cache, tables, seq_lens, 0.3, window=window, softcap=softcap, **qb.scales())
    _assert_decode_exact(out, q, qb, seq_lens, 0.3, window, softcap)


def test_native_hands_the_scales_to_its_fallback() -> None:
    """A quantized cache the kernel does not cover (17 query heads per kv head) goes to the torch path, scales
    and all."""
    q, qb, tables, seq_lens = _decode_case(torch.int8, 3, 1, 17, 16, 16)
    calls = []

    def fallback(*args, **options):  # type: ignore[no-untyped-def]
        calls.append(options)
        return torch_attention.paged_decode_attention(*args, **options)

    out = cpu_attention.NativeDecodeAttention(fallback)(
        q, qb.k_cache, qb.v_cache, tables, seq_lens, 0.25, **qb.scales()
    )
    assert len(calls) == 1 and calls[0]["k_scales"] is qb.k_scales and calls[0]["v_scales"] is qb.v_scales
    _assert_decode_exact(out, q, qb, seq_lens, 0.25)


def test_the_int8_and_fp8_kernels_are_builds_of_their_own(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    cpu_attention.load.cache_clear()
    try:
        for dtype in DTYPES:
            assert cpu_attention.load(32, 2, dtype) is not None
        assert len(list((tmp_path / "kernels").glob("*.so"))) == 2
    finally:
        cpu_attention.load.cache_clear()
