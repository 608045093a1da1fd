"""The layout a rank's cache reports names its dtype: a cache in another float than its peer's (an fp16 KV cache
under a bf16 model beside a bf16 one) does not pair, and the refusal names `format`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from proto.kv_transfer import pairing_problem
from worker_node.kv.cache import allocate_kv_cache
from worker_node.kv.transfer.frames import block_bytes, cache_layout

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Shape:
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 8


def test_caches_of_different_floats_do_not_pair() -> None:
    fp16 = allocate_kv_cache(Shape(), 4, torch.float16, torch.device("cpu"), 3)
    bf16 = allocate_kv_cache(Shape(), 4, torch.bfloat16, torch.device("cpu"), 3)
    fp32 = allocate_kv_cache(Shape(), 4, torch.float32, torch.device("cpu"), 3)
    assert cache_layout(fp16).format == "float16"
    assert pairing_problem(cache_layout(fp16), cache_layout(fp16)) is None
    problem = pairing_problem(cache_layout(fp16), cache_layout(bf16))
    assert problem == "KV layouts do not pair: format is 'float16' here and 'bfloat16' on the other side"
    assert block_bytes(fp16) == block_bytes(bf16) == block_bytes(fp32) // 2  # a transfer moves the cache's own bytes
