"""Random paged-KV batches and a dense float64 attention oracle for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32, shuffled block ids
    seq_lens: torch.Tensor  # [S] int32
    keys: list[torch.Tensor]  # per sequence, contiguous [seq_len, Hkv, D]
    values: list[torch.Tensor]

    def slots(self, seq: int, positions: range) -> torch.Tensor:
        block_size = self.k_cache.shape[1]
        blocks = self.block_tables[seq, [p // block_size for p in positions]].long()
        return blocks * block_size + torch.tensor([p % block_size for p in positions], dtype=torch.long)


def make_paged_batch(
    seq_lens: list[int],
    cached_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedBatch:
    """Sequences whose first `cached_lens[i]` tokens sit in a randomly-filled cache, in shuffled blocks.

    Every unused slot and every padding entry of the block tables points at random data, so a kernel that
    reads a wrong slot or past a sequence's end produces a wrong answer instead of a lucky zero.
    """
    per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(per_seq) + 1
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start : start + n].int()
        start += n
    batch = PagedBatch(k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), [], [])
    for i, (length, cached) in enumerate(zip(seq_lens, cached_lens, strict=True)):
        keys = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = batch.slots(i, range(cached))
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = keys[:cached]
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = values[:cached]
        batch.keys.append(keys)
        batch.values.append(values)
    return batch


def dense_causal_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    first_pos: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """float64 softmax attention of queries at positions first_pos.. over contiguous keys/values (GQA); with
    `window`, a query at position p sees keys p - window + 1 .. p; with `softcap`, scores are soft-capped."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(q.shape[0])[:, None] + first_pos
    cols = torch.arange(k.shape[0])[None, :]
    hidden = (cols > rows) | (cols <= rows - window) if window else cols > rows
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@dataclass
class QuantizedBatch:
    """A PagedBatch's caches quantized, and what an exact kernel must see: each sequence's cached tokens as the
    dequantized cache holds them, then its new tokens at full precision."""

    k_cache: torch.Tensor  # int8 or float8_e4m3fn values
    v_cache: torch.Tensor
    k_scales: torch.Tensor  # [num_blocks, block_size, Hkv] float32
    v_scales: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, [seq_len, Hkv, D] float32
    values: list[torch.Tensor]

    def scales(self) -> dict[str, torch.Tensor]:
        return {"k_scales": self.k_scales, "v_scales": self.v_scales}


def quantize_batch(batch: PagedBatch, cached_lens: list[int], dtype: torch.dtype) -> QuantizedBatch:
    from kernels.kv_quant import dequantize, quantize
    from kernels.torch_attention import gather_kv

    (k_cache, k_scales), (v_cache, v_scales) = quantize(batch.k_cache, dtype), quantize(batch.v_cache, dtype)
    seen_k, seen_v = dequantize(k_cache, k_scales), dequantize(v_cache, v_scales)
    keys, values = [], []
    for i, cached in enumerate(cached_lens):
        table = batch.block_tables[i]
        keys.append(torch.cat([gather_kv(seen_k, table, cached), batch.keys[i][cached:].float()]))
        values.append(torch.cat([gather_kv(seen_v, table, cached), batch.values[i][cached:].float()]))
    return QuantizedBatch(k_cache, v_cache, k_scales, v_scales, keys, values)
