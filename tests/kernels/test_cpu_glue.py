"""The compiled layer glue (kernels/cpu_glue.py) against the torch ops it replaces, and its fallbacks."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_glue, torch_attention
from worker_node.models.layers import apply_rope

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: float32 rounding; bf16: one rounding of the result (torch's chain may round a step more)."""
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1.6e-2)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    for dtype in DTYPES:
        assert cpu_glue.load(dtype) is not None, "the C kernel must build on the test machines (gcc is in the set-up)"


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """In float64: the rounding of x and weight is the inputs', the kernel's is float32 arithmetic and its output's."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return normed * (offset + weight.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (3, 17), (64, 576), (300, 1000)])  # 300 x 1000: threads
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_reference(dtype: torch.dtype, rows: int, width: int, offset: float) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    out, residual = cpu_glue.rms_norm(x, weight, 1e-5, offset)
    assert residual is x and out.dtype == dtype
    assert_close(out.double(), reference_norm(x, weight, 1e-5, offset), dtype)
    # and the torch path's result (what runs where the kernel does not)
    assert_close(out, cpu_glue._torch_rms_norm(x, weight, 1e-5, offset, None)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 64), (5, 33), (300, 1000)])
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(3 * rows + width)
    x, delta = ((torch.randn(rows, width, generator=gen) * 2).to(dtype) for _ in range(2))
    weight = torch.randn(width, generator=gen).to(dtype)
    before = x.clone()
    out, residual = cpu_glue.rms_norm(x, weight, 1e-6, 0.0, delta)
    assert torch.equal(x, before), "the input residual is left as it was"
    assert torch.equal(residual, x + delta), "the sum is torch's, rounded the same way"
    assert_close(out.double(), reference_norm(x + delta, weight, 1e-6, 0.0), dtype)


@pytest.mark.parametrize(("rows", "width"), [(1, 576), (5, 33), (300, 1000)])  # 300 x 1000: threads
def test_a_float32_residual_stream_is_summed_unrounded_and_normed_in_the_weights_dtype(rows: int, width: int) -> None:
    """A bf16 model's residual stream is float32 (decoder.residual_stream): the sum stays float32, the norm is bf16."""
    gen = torch.Generator().manual_seed(5 * rows + width)
    x = torch.randn(rows, width, generator=gen) * 2
    delta = (torch.randn(rows, width, generator=gen) * 2).bfloat16()
    weight = torch.randn(width, generator=gen).bfloat16()
    out, residual = cpu_glue.rms_norm(x, weight, 1e-6, 0.0, delta)
    assert residual.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.equal(residual, x + delta.float()), "the sum is float32's, not rounded to bf16"
    assert_close(out.double(), reference_norm(residual, weight, 1e-6, 0.0), torch.bfloat16)
    assert_close(out, cpu_glue._torch_rms_norm(x, weight, 1e-6, 0.0, delta)[0], torch.bfloat16)
    alone, same = cpu_glue.rms_norm(x, weight, 1e-6, 1.0)  # the first layer's: no delta, Gemma's offset
    assert same is x and alone.dtype == torch.bfloat16
    assert_close(alone.double(), reference_norm(x, weight, 1e-6, 1.0), torch.bfloat16)


def test_rms_norm_reads_strided_rows_and_3d() -> None:
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(7, 40, generator=gen)
    x, delta = wide[:, :24], wide[:, 16:]  # rows 40 apart
    weight = torch.randn(24, generator=gen)
    out, residual = cpu_glue.rms_norm(x, weight, 1e-5, 0.0, delta)
    torch.testing.assert_close(out.double(), reference_norm(x + delta, weight, 1e-5, 0.0), atol=1e-5, rtol=1e-5)
    heads = torch.randn(3, 4, 16, generator=gen)  # Qwen3's per-head q/k norm
    out, _ = cpu_glue.rms_norm(heads, weight[:16], 1e-5)
    assert out.shape == heads.shape
    torch.testing.assert_close(out.double(), reference_norm(heads, weight[:16], 1e-5, 0.0), atol=1e-5, rtol=1e-5)


def angles(tokens: int, rot: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.rand(tokens, rot // 2, generator=gen) * 50
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().unsqueeze(1).to(dtype), emb.sin().unsqueeze(1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "rot"),
    [(1, 9, 3, 64, 64), (5, 3, 1, 34, 34), (70, 9, 3, 64, 64), (400, 9, 3, 64, 64), (4, 4, 2, 32, 16)],
)
def test_rotary_matches_apply_rope(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int, rot: int
) -> None:
    """q and k as the attention layer has them: views into one fused QKV row; partial rotary (16 of 32) too."""
    gen = torch.Generator().manual_seed(tokens + heads + rot)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cos, sin = angles(tokens, rot, dtype, gen)
    want_q, want_k = (apply_rope(t.double(), (cos.double(), sin.double())) for t in (q, k))
    assert cpu_glue.rotary_(q, k, cos, sin)
    assert_close(q.double(), want_q, dtype)
    assert_close(k.double(), want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before), "v is not touched"


def test_rotary_declines_what_it_does_not_read() -> None:
    gen = torch.Generator().manual_seed(1)
    cos, sin = angles(3, 8, torch.float32, gen)
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    assert not cpu_glue.rotary_(q.half(), k.half(), cos.half(), sin.half()), "float16: no build"
    assert not cpu_glue.rotary_(q.transpose(0, 1), k, cos, sin), "heads not contiguous inside a token"
    assert not cpu_glue.rotary_(q, k, cos.double(), sin.double()), "angles of another dtype"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (3, 7), (64, 1536), (150, 2000)])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    gate, up = gate_up.double().split(width, dim=-1)
    out = cpu_glue.silu_mul(gate_up)
    assert out.shape == (rows, width) and out.dtype == dtype
    assert_close(out.double(), F.silu(gate) * up, dtype)


def test_other_dtypes_and_layouts_take_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(4, 10, generator=gen, dtype=torch.float64)
    gate, up = gate_up.split(5, dim=-1)
    assert torch.equal(cpu_glue.silu_mul(gate_up), F.silu(gate) * up)
    strided = torch.randn(10, 4, generator=gen).t()
    gate, up = strided.split(5, dim=-1)
    torch.testing.assert_close(cpu_glue.silu_mul(strided), F.silu(gate) * up)
    x, weight = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(cpu_glue.rms_norm(x, weight, 1e-5)[0], reference_norm(x, weight, 1e-5, 0.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_puts_each_token_s_rows_where_torch_does(dtype: torch.dtype) -> None:
    """The new tokens' K/V (views of a fused QKV output: rows lie apart) into their slots, bit for bit torch's."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16, generator=gen).to(dtype)
    key = qkv[:, 64:96].view(5, 2, 16)
    value = qkv[:, 96:].view(5, 2, 16)
    slots = torch.tensor([7, 0, 33, 12, 63])
    caches = [torch.zeros(4, 16, 2, 16, dtype=dtype) for _ in range(4)]
    cpu_glue.write_kv(key, value, caches[0], caches[1], slots)
    torch_attention.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0].view(-1, 2, 16)[33], key[2])


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing() -> None:
    key = torch.ones(2, 2, 16)
    k_cache, v_cache = torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)
    with pytest.raises(IndexError, match="outside the cache's 64 slots"):
        cpu_glue.write_kv(key, key, k_cache, v_cache, torch.tensor([3, 64]))
    assert not k_cache.any() and not v_cache.any()


def test_a_quantized_cache_is_written_by_torch() -> None:
    """int8 codes and their scales: what torch's write makes (the C copy holds rows as they are)."""
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    slots = torch.tensor([1, 20, 5])
    made = []
    for write in (cpu_glue.write_kv, torch_attention.write_kv):
        caches = [torch.zeros(4, 16, 2, 16, dtype=torch.int8) for _ in range(2)]
        scales = [torch.zeros(4, 16, 2) for _ in range(2)]
        write(key, value, caches[0], caches[1], slots, k_scales=scales[0], v_scales=scales[1])
        made.append((caches, scales))
    (c1, s1), (c2, s2) = made
    assert all(torch.equal(a, b) for a, b in zip(c1 + s1, c2 + s2))
