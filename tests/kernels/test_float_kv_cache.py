"""A KV cache in another float than the model's through `worker_node.models.attention.paged_attention` on every
backend (torch, native, Triton in its interpreter: tiny shapes): bf16 queries, keys and values over an fp16 cache
give bf16 outputs within bf16 rounding of the same step over a bf16 cache and of float64 attention, and the cache
holds the keys as fp16. A prefill of two sequences, then one decode step each that reads what the prefill wrote."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.backend import select_attention_backend  # noqa: E402
from worker_node.kv.cache import LayerKV  # noqa: E402
from worker_node.models.attention import AttentionMetadata, paged_attention  # noqa: E402

pytestmark = pytest.mark.model

BS, HKV, H, D = 4, 2, 4, 16
LENS = [6, 9]
QKV = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]  # prefill lengths: across a block boundary, two and a quarter blocks


def _meta(slots: list[int], decode: bool, tables: torch.Tensor, lens: list[int]) -> AttentionMetadata:
    n = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor([1] * n if decode else lens).cumsum(0).tolist()], dtype=torch.int32)
    empty = torch.zeros((0, tables.shape[1]), dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=n if decode else 0,
        decode_block_tables=tables if decode else empty,
        decode_seq_lens=seq_lens if decode else torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=empty if decode else tables,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32) if decode else cu,
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32) if decode else seq_lens,
    )


def _run(backend_name: str, cache_dtype: torch.dtype, qkv: list[QKV]) -> list[torch.Tensor]:
    backend = select_attention_backend(backend_name, torch.device("cpu"))
    cache = LayerKV(torch.zeros(8, BS, HKV, D, dtype=cache_dtype), torch.zeros(8, BS, HKV, D, dtype=cache_dtype))
    tables = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 7]], dtype=torch.int32)
    prefill_slots = [int(tables[s, p // BS]) * BS + p % BS for s, n in enumerate(LENS) for p in range(n)]
    decode_slots = [int(tables[s, n // BS]) * BS + n % BS for s, n in enumerate(LENS)]
    scale = D**-0.5
    out = [paged_attention(backend, *qkv[0], cache, _meta(prefill_slots, False, tables, LENS), scale)]
    out.append(
        paged_attention(backend, *qkv[1], cache, _meta(decode_slots, True, tables, [n + 1 for n in LENS]), scale)
    )
    assert cache.k.dtype == cache_dtype and cache.k.view(-1, HKV, D)[prefill_slots].float().abs().sum() > 0
    return out


def _reference(qkv: list[QKV]) -> list[torch.Tensor]:
    """float64 causal attention per sequence over the same bf16 inputs."""
    (q, k, v), (qd, kd, vd) = [tuple(t.double() for t in step) for step in qkv]
    prefill, decode, start = [], [], 0
    for s, n in enumerate(LENS):
        keys = torch.cat([k[start : start + n], kd[s : s + 1]]).repeat_interleave(H // HKV, 1)
        values = torch.cat([v[start : start + n], vd[s : s + 1]]).repeat_interleave(H // HKV, 1)
        queries = torch.cat([q[start : start + n], qd[s : s + 1]])
        scores = torch.einsum("thd,shd->hts", queries, keys) * D**-0.5
        scores += torch.full((n + 1, n + 1), float("-inf"), dtype=torch.float64).triu(1)
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), values)
        prefill.append(out[:n])
        decode.append(out[n:])
        start += n
    return [torch.cat(prefill), torch.cat(decode)]


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_an_fp16_cache_under_bf16_activations(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)

    def rows(t: int) -> QKV:
        shapes = [(t, H, D), (t, HKV, D), (t, HKV, D)]
        q, k, v = (torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes)
        return q, k, v

    qkv = [rows(sum(LENS)), rows(len(LENS))]
    fp16, bf16, exact = _run(backend, torch.float16, qkv), _run(backend, torch.bfloat16, qkv), _reference(qkv)
    for ours, same_dtype, reference in zip(fp16, bf16, exact):
        assert ours.dtype == torch.bfloat16
        assert (ours.double() - reference).abs().max() < 2e-2  # bf16 rounding of the output (8 bits) and inputs
        assert (ours.double() - reference).abs().max() <= (same_dtype.double() - reference).abs().max() + 1e-2
