"""The rank layout of tensor x pipeline parallelism (proto/parallel.py): rank r is TP rank r % T of stage r // T;
layers, heads and vocabulary rows split evenly; a split the model cannot take is refused naming the numbers."""

from __future__ import annotations

import pytest

from proto.parallel import ParallelLayout, kv_head_range, shard, vocab_shard

pytestmark = pytest.mark.unit


def test_ranks_stages_and_the_output_rank() -> None:
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.world_size == 6 and layout.output_rank == 4  # TP rank 0 of the last stage
    assert [(layout.stage_of(r), layout.tp_rank_of(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]  # fmt: skip
    assert layout.stage_ranks(1) == [2, 3]
    assert [layout.layer_range(s, 10) for s in range(3)] == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(ValueError, match="rank 6 is outside a world of 6"):
        layout.stage_of(6)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelLayout(0)


def test_heads_and_vocabulary_rows_split_evenly_or_replicate() -> None:
    assert [shard(12, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert [kv_head_range(4, 2, t) for t in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(2, 4, t) for t in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # fewer heads: replicated
    assert [vocab_shard(10, 4, t) for t in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]  # the last one padded


def test_a_split_the_model_cannot_take_names_the_numbers() -> None:
    ParallelLayout(2, 2).check_model(num_heads=8, num_kv_heads=2, intermediate_size=64, num_layers=4)
    with pytest.raises(ValueError, match="must divide the MLP width 30"):
        ParallelLayout(4).check_model(8, 4, 30, 4)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 5 exceeds the model's 4 layers"):
        ParallelLayout(1, 5).check_model(8, 4, 64, 4)
