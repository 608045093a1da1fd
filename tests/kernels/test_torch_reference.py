"""The torch paged-attention reference against dense causal attention over contiguous K/V."""

import pytest
import torch

from kernels import torch_attention
from tests.support.paged_inputs import dense_causal_attention, make_paged_batch, rel_err

pytestmark = pytest.mark.unit

HEAD_DIM = 32
NUM_KV_HEADS = 2


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_dense(block_size: int, group: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 10 + group)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    batch = make_paged_batch(lens, lens, NUM_KV_HEADS, HEAD_DIM, block_size, torch.float32, gen)
    q = torch.randn(len(lens), NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    out = torch_attention.paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.3
    )
    for i, n in enumerate(lens):
        want = dense_causal_attention(q[i : i + 1], batch.keys[i], batch.values[i], 0.3, n - 1)
        assert rel_err(out[i : i + 1], want) < 1e-5, f"sequence {i} of length {n}"


@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_matches_dense(group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    block_size = 16
    # (cached prefix, new tokens): no prefix, prefix ending mid-block, on a block boundary, single new token
    pairs = [(0, 5), (0, 17), (10, 7), (16, 16), (33, 1), (5, 40)]
    lens = [p + n for p, n in pairs]
    batch = make_paged_batch(lens, [p for p, _ in pairs], NUM_KV_HEADS, HEAD_DIM, block_size, torch.float32, gen)
    q = torch.randn(sum(n for _, n in pairs), NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    k = torch.cat([batch.keys[i][p:] for i, (p, _) in enumerate(pairs)])
    v = torch.cat([batch.values[i][p:] for i, (p, _) in enumerate(pairs)])
    cu = torch.tensor([0] + [n for _, n in pairs], dtype=torch.int32).cumsum(0).int()
    out = torch_attention.paged_prefill_attention(
        q, k, v, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, 0.3
    )
    for i, (prefix, _) in enumerate(pairs):
        lo, hi = int(cu[i]), int(cu[i + 1])
        want = dense_causal_attention(q[lo:hi], batch.keys[i], batch.values[i], 0.3, prefix)
        assert rel_err(out[lo:hi], want) < 1e-5, f"sequence {i} with prefix {prefix}"


def test_write_kv_then_gather_round_trips() -> None:
    gen = torch.Generator().manual_seed(7)
    lens = [3, 16, 21]
    batch = make_paged_batch(lens, [0, 0, 0], NUM_KV_HEADS, HEAD_DIM, 16, torch.float32, gen)
    slots = torch.cat([batch.slots(i, range(n)) for i, n in enumerate(lens)])
    torch_attention.write_kv(torch.cat(batch.keys), torch.cat(batch.values), batch.k_cache, batch.v_cache, slots)
    for i, n in enumerate(lens):
        table = batch.block_tables[i]
        assert torch.equal(torch_attention.gather_kv(batch.k_cache, table, n), batch.keys[i])
        assert torch.equal(torch_attention.gather_kv(batch.v_cache, table, n), batch.values[i])


# (window, softcap): a window inside one block, one spanning blocks, a soft-cap alone, and both together
WINDOWED = [(5, 0.0), (21, 0.0), (0, 2.0), (21, 2.0)]


@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
def test_decode_with_window_and_softcap_matches_dense(window: int, softcap: float) -> None:
    gen = torch.Generator().manual_seed(window + int(softcap))
    lens = [1, 4, 5, 6, 16, 21, 22, 70]  # shorter than, equal to and past each window
    batch = make_paged_batch(lens, lens, NUM_KV_HEADS, HEAD_DIM, 16, torch.float32, gen)
    q = torch.randn(len(lens), NUM_KV_HEADS * 2, HEAD_DIM, generator=gen) * 3  # scores large enough to be capped
    out = torch_attention.paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.3, window=window, softcap=softcap
    )
    for i, n in enumerate(lens):
        want = dense_causal_attention(q[i : i + 1], batch.keys[i], batch.values[i], 0.3, n - 1, window, softcap)
        assert rel_err(out[i : i + 1], want) < 1e-5, f"sequence {i} of length {n}"


@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
def test_prefill_with_window_and_softcap_matches_dense(window: int, softcap: float) -> None:
    gen = torch.Generator().manual_seed(window + int(softcap))
    pairs = [(0, 30), (10, 7), (16, 16), (33, 1), (5, 40)]  # (cached prefix, new tokens)
    lens = [p + n for p, n in pairs]
    batch = make_paged_batch(lens, [p for p, _ in pairs], NUM_KV_HEADS, HEAD_DIM, 16, torch.float32, gen)
    q = torch.randn(sum(n for _, n in pairs), NUM_KV_HEADS * 2, HEAD_DIM, generator=gen) * 3
    k = torch.cat([batch.keys[i][p:] for i, (p, _) in enumerate(pairs)])
    v = torch.cat([batch.values[i][p:] for i, (p, _) in enumerate(pairs)])
    cu = torch.tensor([0] + [n for _, n in pairs], dtype=torch.int32).cumsum(0).int()
    out = torch_attention.paged_prefill_attention(
        q,
        k,
        v,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        cu,
        batch.seq_lens,
        0.3,
        window=window,
        softcap=softcap,
    )
    for i, (prefix, _) in enumerate(pairs):
        lo, hi = int(cu[i]), int(cu[i + 1])
        want = dense_causal_attention(q[lo:hi], batch.keys[i], batch.values[i], 0.3, prefix, window, softcap)
        assert rel_err(out[lo:hi], want) < 1e-5, f"sequence {i} with prefix {prefix}"
