"""The rank layout of tensor × pipeline parallelism, shared by the scheduler (placement) and the workers (shards).

Rank r is TP rank `r % T` of pipeline stage `r // T`: the T ranks of a stage are consecutive, so a TP group is
a contiguous run of ranks. The output rank, the one that samples and whose StepResult the scheduler reads, is
TP rank 0 of the last stage. Pure Python: the scheduler never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def stage_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.tensor_parallel_size

    def tp_rank_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.tensor_parallel_size

    def stage_ranks(self, stage: int) -> list[int]:
        first = stage * self.tensor_parallel_size
        return list(range(first, first + self.tensor_parallel_size))

    def layer_range(self, stage: int, num_layers: int) -> tuple[int, int]:
        """The decoder layers [start, end) of a stage: an even split, later stages take the remainder."""
        p = self.pipeline_parallel_size
        return stage * num_layers // p, (stage + 1) * num_layers // p

    def check_model(self, num_heads: int, num_kv_heads: int, intermediate_size: int, num_layers: int) -> None:
        """Raise ValueError (naming the numbers) when the model cannot be split this way."""
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        if num_heads % t:
            raise ValueError(f"--tensor-parallel-size {t} must divide the model's {num_heads} attention heads")
        if num_kv_heads >= t and num_kv_heads % t:
            raise ValueError(f"--tensor-parallel-size {t} must divide the model's {num_kv_heads} KV heads")
        if num_kv_heads < t and t % num_kv_heads:
            raise ValueError(
                f"--tensor-parallel-size {t} exceeds the model's {num_kv_heads} KV heads and is not a multiple "
                "of them, so KV heads cannot be replicated evenly"
            )
        if intermediate_size % t:
            raise ValueError(f"--tensor-parallel-size {t} must divide the MLP width {intermediate_size}")
        if num_layers < p:
            raise ValueError(f"--pipeline-parallel-size {p} exceeds the model's {num_layers} layers")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")


def shard(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` splits evenly into `parts`."""
    size = total // parts
    return index * size, (index + 1) * size


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads a TP rank holds: an even split, or one replicated head when there are fewer heads than ranks.

    With H query heads, query head h reads KV head h // (H / Hkv); rank t holds query heads
    [t·H/T, (t+1)·H/T), all of which read KV head t // (T / Hkv) when T > Hkv.
    """
    if num_kv_heads >= tp_size:
        return shard(num_kv_heads, tp_size, tp_rank)
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, start + rows) of a rank's vocab rows; every rank holds ceil(V / T) rows, the last one padded."""
    rows = -(-vocab_size // tp_size)
    return tp_rank * rows, (tp_rank + 1) * rows
