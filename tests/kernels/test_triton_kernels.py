"""Each Triton kernel against the torch reference, run in Triton's interpreter (TRITON_INTERPRET=1, conftest).

Shapes stay tiny: the interpreter executes every program in Python. bf16 attention is checked on a GPU by
scripts/bench_kernels.py only, because the interpreter's `tl.dot` multiplies raw bf16 bit patterns.
"""

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kernels import torch_attention as ref  # noqa: E402
from kernels import triton_attention as tri  # noqa: E402
from kernels import triton_decode, triton_prefill  # noqa: E402
from kernels.backend import select_attention_backend  # noqa: E402
from tests.support.paged_inputs import make_paged_batch, rel_err  # noqa: E402

pytestmark = pytest.mark.unit

SCALE = 0.3


class _PoisonedTorch:
    """`torch` as the kernel modules see it, except that fresh buffers start as NaN instead of garbage."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def empty(size: tuple[int, ...], **kw: Any) -> torch.Tensor:
        return torch.full(size, float("nan"), **kw)

    @staticmethod
    def empty_like(t: torch.Tensor, **kw: Any) -> torch.Tensor:
        return torch.full_like(t, float("nan"), **kw)


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and split-KV scratch start as NaN, so any element a kernel forgets to write shows up."""
    for module in (triton_decode, triton_prefill):
        monkeypatch.setattr(module, "torch", _PoisonedTorch())


@pytest.mark.parametrize(
    ("block_size", "kv_dtype", "cache_dtype"),
    [
        (16, torch.float32, torch.float32),
        (32, torch.float32, torch.float16),
        (64, torch.bfloat16, torch.bfloat16),
    ],
)
def test_write_kv_matches_reference(block_size: int, kv_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    # (the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest, hence no fp32 -> bf16 case)
    gen = torch.Generator().manual_seed(block_size)
    num_kv_heads, head_dim, num_blocks = 3, 64, 6
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    # A strided view, as when keys and values are slices of one fused projection.
    kv = torch.randn(9, 2, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9]
    want_k, want_v = cache.clone(), cache.clone() + 1
    ref.write_kv(key, value, want_k, want_v, slots)
    got_k, got_v = cache.clone(), cache.clone() + 1
    tri.write_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)


def test_write_kv_skips_negative_slots() -> None:
    cache = torch.full((2, 16, 1, 64), float("nan"))
    key = torch.randn(3, 1, 64)
    tri.write_kv(key, key + 1, cache, cache.clone(), torch.tensor([5, -1, 20]))
    written = cache.view(-1, 1, 64)
    assert torch.equal(written[[5, 20]], key[[0, 2]])
    assert written[[i for i in range(32) if i not in (5, 20)]].isnan().all()


DECODE_CASES = [
    # block_size, GQA group, head_dim, seq lens, forced segments (None: the heuristic)
    (16, 1, 64, [1, 17, 40], None),
    (16, 2, 128, [50, 16], 1),
    (32, 4, 64, [33, 5, 64], 3),
    (64, 8, 64, [70, 1], 2),
    (64, 4, 128, [300, 129], None),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "lens", "segments"), DECODE_CASES)
def test_decode_matches_reference(
    poisoned_outputs: None, block_size: int, group: int, head_dim: int, lens: list[int], segments: int | None
) -> None:
    gen = torch.Generator().manual_seed(block_size + group)
    batch = make_paged_batch(lens, lens, 2, head_dim, block_size, torch.float32, gen)
    q = torch.randn(len(lens), 2 * group, head_dim, generator=gen)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, SCALE)
    out = tri.paged_decode_attention(*args, num_segments=segments)
    assert rel_err(out, ref.paged_decode_attention(*args)) < 1e-5


PREFILL_CASES = [
    # block_size, GQA group, head_dim, (cached prefix, new tokens) per sequence
    (16, 1, 64, [(0, 5), (20, 33)]),
    (32, 2, 128, [(0, 40), (37, 3)]),
    (64, 4, 64, [(70, 20), (0, 1), (5, 16)]),
    (16, 8, 64, [(16, 16)]),
]


def _prefill_args(
    block_size: int, group: int, head_dim: int, pairs: list[tuple[int, int]], dtype: torch.dtype
) -> tuple:
    gen = torch.Generator().manual_seed(block_size + group + len(pairs))
    lens = [p + n for p, n in pairs]
    batch = make_paged_batch(lens, [p for p, _ in pairs], 2, head_dim, block_size, dtype, gen)
    q = torch.randn(sum(n for _, n in pairs), 2 * group, head_dim, generator=gen).to(dtype)
    k = torch.cat([batch.keys[i][p:] for i, (p, _) in enumerate(pairs)])
    v = torch.cat([batch.values[i][p:] for i, (p, _) in enumerate(pairs)])
    cu = torch.tensor([0] + [n for _, n in pairs]).cumsum(0).int()
    return q, k, v, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, SCALE


@pytest.mark.parametrize(("block_size", "group", "head_dim", "pairs"), PREFILL_CASES)
def test_prefill_matches_reference(
    poisoned_outputs: None, block_size: int, group: int, head_dim: int, pairs: list[tuple[int, int]]
) -> None:
    args = _prefill_args(block_size, group, head_dim, pairs, torch.float32)
    assert rel_err(tri.paged_prefill_attention(*args), ref.paged_prefill_attention(*args)) < 1e-5


def test_fp16_attention_through_backend(poisoned_outputs: None) -> None:
    """fp16 in, fp16 out, fp32 accumulation: within fp16 rounding of the reference."""
    backend = select_attention_backend("triton", torch.device("cpu"))
    args = _prefill_args(32, 2, 64, [(30, 9), (0, 20)], torch.float16)
    out = backend.prefill_attention(*args)
    assert out.dtype == torch.float16
    assert rel_err(out, ref.paged_prefill_attention(*args)) < 2e-3
    q, _, _, k_cache, v_cache, tables, _, seq_lens, _ = args
    decode_args = (q[:2], k_cache, v_cache, tables, seq_lens, SCALE)
    out = backend.decode_attention(*decode_args)
    assert rel_err(out, ref.paged_decode_attention(*decode_args)) < 2e-3


def test_strided_q_and_odd_kv_head_count(poisoned_outputs: None) -> None:
    """q/k/v as views of one fused projection output, 3 KV heads (not a power of two), GQA group 2."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, group, head_dim, pairs = 3, 2, 64, [(12, 20), (0, 9)]
    lens = [p + n for p, n in pairs]
    batch = make_paged_batch(lens, [p for p, _ in pairs], kv_heads, head_dim, 16, torch.float32, gen)
    fused = torch.randn(sum(n for _, n in pairs), kv_heads * (group + 2), head_dim, generator=gen)
    q, k, v = fused.split([kv_heads * group, kv_heads, kv_heads], dim=1)
    cu = torch.tensor([0] + [n for _, n in pairs]).cumsum(0).int()
    args = (q, k, v, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, SCALE)
    assert rel_err(tri.paged_prefill_attention(*args), ref.paged_prefill_attention(*args)) < 1e-5
    decode_args = (q[:2], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, SCALE)
    for segments in (1, 2):
        out = tri.paged_decode_attention(*decode_args, num_segments=segments)
        assert rel_err(out, ref.paged_decode_attention(*decode_args)) < 1e-5


# window, softcap, forced decode segments: a window inside one key tile, one across tiles and blocks (whole
# segments before it), a soft-cap alone, both
WINDOW_CASES = [(5, 0.0, 4), (20, 0.0, 3), (0, 2.0, 2), (37, 2.0, None)]


@pytest.mark.parametrize(("window", "softcap", "segments"), WINDOW_CASES)
def test_decode_with_window_and_softcap(
    poisoned_outputs: None, window: int, softcap: float, segments: int | None
) -> None:
    gen = torch.Generator().manual_seed(window)
    lens = [1, 6, 21, 70]
    batch = make_paged_batch(lens, lens, 2, 32, 16, torch.float32, gen)
    q = torch.randn(len(lens), 4, 32, generator=gen) * 3  # scores large enough to be capped
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, SCALE)
    out = tri.paged_decode_attention(*args, window=window, softcap=softcap, num_segments=segments)
    assert rel_err(out, ref.paged_decode_attention(*args, window=window, softcap=softcap)) < 1e-5


@pytest.mark.parametrize(("window", "softcap", "_"), WINDOW_CASES)
def test_prefill_with_window_and_softcap(poisoned_outputs: None, window: int, softcap: float, _: object) -> None:
    # 45 new tokens: two query tiles, the second's window starting inside the first's keys
    q, *rest = _prefill_args(16, 2, 32, [(0, 45), (30, 20), (5, 1)], torch.float32)
    args = (q * 3, *rest)
    out = tri.paged_prefill_attention(*args, window=window, softcap=softcap)
    assert rel_err(out, ref.paged_prefill_attention(*args, window=window, softcap=softcap)) < 1e-5
