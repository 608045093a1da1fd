"""The Triton kernels over a quantized KV cache (int8, fp8 e4m3), in Triton's interpreter (TRITON_INTERPRET=1,
conftest): the write kernel writes the torch reference's bytes and scales; decode and prefill match float64
attention over the dequantized cache. Shapes stay tiny: the interpreter runs every program in Python."""

import pytest
import torch

pytest.importorskip("triton")

from kernels import torch_attention as ref  # noqa: E402
from kernels import triton_attention as tri  # noqa: E402
from kernels.kv_quant import FORMATS, as_bytes, quantize  # noqa: E402
from tests.support.paged_inputs import (  # noqa: E402
    dense_causal_attention,
    make_paged_batch,
    quantize_batch,
    rel_err,
)

pytestmark = pytest.mark.unit

DTYPES = list(FORMATS.values())
SCALE = 0.3


def _empty_cache(dtype: torch.dtype, num_blocks: int = 6, block_size: int = 16, heads: int = 3, dim: int = 32):  # type: ignore[no-untyped-def]
    values = torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype)
    scales = torch.full((num_blocks, block_size, heads), -1.0)  # no kernel writes a negative scale
    return [values, values.clone(), scales, scales.clone()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_writes_the_references_bytes(dtype: torch.dtype) -> None:
    """Rows of every magnitude (e4m3 subnormals included), as strided views of one fused projection."""
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(9, 2, 3, 32, generator=gen) * torch.logspace(-4, 4, 32)  # per dim: 1e-4 .. 1e4
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(6 * 16, generator=gen)[:9]
    want, got = _empty_cache(dtype), _empty_cache(dtype)
    ref.write_kv(key, value, want[0], want[1], slots, k_scales=want[2], v_scales=want[3])
    tri.write_kv(key, value, got[0], got[1], slots, k_scales=got[2], v_scales=got[3])
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g), as_bytes(w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_negative_slots_and_their_scales(dtype: torch.dtype) -> None:
    got = _empty_cache(dtype, heads=1)
    key = torch.randn(3, 1, 32)
    tri.write_kv(key, key + 1, got[0], got[1], torch.tensor([5, -1, 20]), k_scales=got[2], v_scales=got[3])
    k_scales = got[2].view(-1)
    assert torch.equal(k_scales[[5, 20]], quantize(key[[0, 2]], dtype)[1][:, 0])
    assert (k_scales[[i for i in range(96) if i not in (5, 20)]] == -1).all()


def test_the_kernels_refuse_a_quantized_cache_without_scales() -> None:
    cache = torch.zeros(2, 16, 1, 32, dtype=torch.int8)
    q = torch.randn(1, 1, 32)
    with pytest.raises(ValueError, match="quantized: k_scales and v_scales are needed"):
        tri.write_kv(q, q, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="quantized: k_scales and v_scales are needed"):
        tri.paged_decode_attention(q, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1), 1.0)
    with pytest.raises(ValueError, match="scales must be contiguous torch.float32"):
        scales = torch.zeros(2, 16, 1, dtype=torch.float64)
        tri.write_kv(q, q, cache, cache.clone(), torch.tensor([0]), k_scales=scales, v_scales=scales)


# forced decode segments, window, softcap: one segment, a split with a window across blocks and a soft-cap
DECODE = [(1, 0, 0.0), (3, 21, 2.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("segments", "window", "softcap"), DECODE)
def test_decode_matches_float64(dtype: torch.dtype, segments: int, window: int, softcap: float) -> None:
    gen = torch.Generator().manual_seed(segments)
    lens = [1, 17, 40]
    batch = make_paged_batch(lens, lens, 2, 32, 16, torch.float32, gen)
    qb = quantize_batch(batch, lens, dtype)
    q = torch.randn(len(lens), 4, 32, generator=gen) * 3
    out = tri.paged_decode_attention(
        q, qb.k_cache, qb.v_cache, batch.block_tables, batch.seq_lens, SCALE, window=window, softcap=softcap,
        num_segments=segments, **qb.scales(),
    )  # fmt: skip
    for i, n in enumerate(lens):
        want = dense_causal_attention(q[i : i + 1], qb.keys[i], qb.values[i], SCALE, n - 1, window, softcap)
        assert rel_err(out[i : i + 1], want) < 1e-5, f"sequence {i} of length {n}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (20, 2.0)])
def test_prefill_matches_float64(dtype: torch.dtype, window: int, softcap: float) -> None:
    """The cached prefix is read quantized; the new tokens attend to each other at full precision."""
    gen = torch.Generator().manual_seed(window)
    pairs = [(20, 33), (5, 1)]  # (cached prefix, new tokens): two query tiles over a prefix ending mid-block
    lens, cached = [p + n for p, n in pairs], [p for p, _ in pairs]
    batch = make_paged_batch(lens, cached, 2, 32, 16, torch.float32, gen)
    qb = quantize_batch(batch, cached, dtype)
    q = torch.randn(sum(n for _, n in pairs), 4, 32, generator=gen) * 3
    k = torch.cat([batch.keys[i][p:] for i, p in enumerate(cached)])
    v = torch.cat([batch.values[i][p:] for i, p in enumerate(cached)])
    cu = torch.tensor([0] + [n for _, n in pairs]).cumsum(0).int()
    out = tri.paged_prefill_attention(
        q, k, v, qb.k_cache, qb.v_cache, batch.block_tables, cu, batch.seq_lens, SCALE, window=window,
        softcap=softcap, **qb.scales(),
    )  # fmt: skip
    for i, p in enumerate(cached):
        lo, hi = int(cu[i]), int(cu[i + 1])
        want = dense_causal_attention(q[lo:hi], qb.keys[i], qb.values[i], SCALE, p, window, softcap)
        assert rel_err(out[lo:hi], want) < 1e-5, f"sequence {i} with prefix {p}"
