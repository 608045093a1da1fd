"""A plan's KV moves on their own (worker_node/kv/moves.py): what a worker refuses to move, and the requests a
failed load leaves out. Moves that run (swaps, tiers, imports) are in test_kv_offload.py, test_kv_transfer.py and
tests/fidelity/test_disagg_handoff.py, through the runner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from proto.wire import CachedRequest, KVGrant, NewRequest, SamplingOptions, StepPlan, TierMove, pack_int32
from worker_node.input_batch import InputBatch
from worker_node.kv.moves import KVMoves, LoadFailures
from worker_node.runtime.parallel import SINGLE, Comm

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _bare_moves() -> KVMoves:
    """A worker with no swap space, no offload tiers and no KV transfer."""
    return KVMoves([], [], [], Comm(SINGLE), CPU)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda p: setattr(p, "swap_out", [(3, 0)]), "swap block 0 is outside"),
        (lambda p: setattr(p, "swap_in", [(0, 99)]), "swapped block id .* 99 is outside"),
        (lambda p: setattr(p, "kv_grants", [KVGrant(bytes(16), [1])]), "no KV transfer set up"),
        (lambda p: setattr(p, "tier_moves", [TierMove(0, 1, 1, 0, b"h")]), "no offload tiers"),
    ],
)
def test_a_worker_refuses_moves_it_cannot_make(change, error: str) -> None:  # type: ignore[no-untyped-def]
    plan = StepPlan(1)
    change(plan)
    with pytest.raises(ValueError, match=error):
        _bare_moves().check(plan, full_limit=16)


def test_a_plan_without_moves_passes_the_check() -> None:
    _bare_moves().check(StepPlan(1), full_limit=16)


def _held(batch: InputBatch, handle: int, blocks: list[int]) -> None:
    batch.add(NewRequest(handle, [5] * 8, [], SamplingOptions(temperature=0.0), blocks, 0, 8))


def test_a_failed_load_leaves_out_exactly_the_requests_that_read_its_block_until_they_are_forgotten() -> None:
    batch = InputBatch(4, CPU)
    for handle, blocks in ((1, [0, 1]), (2, [2, 3]), (3, [1, 4])):
        _held(batch, handle, blocks)
    failures = LoadFailures()
    assert not failures and failures.leave_out(set(), batch) == []
    assert sorted(failures.leave_out({1}, batch)) == [1, 3], "both requests that read block 1"
    assert failures.leave_out({1, 4}, batch) == [], "each is left out once"
    assert 1 in failures and 2 not in failures

    plan = StepPlan(2)
    plan.new_requests = [NewRequest(5, [7] * 4, [], SamplingOptions(temperature=0.0), [6], 0, 4)]
    plan.cached_requests = [CachedRequest(3, 8, 1), CachedRequest(2, 8, 1)]
    plan.decode_handles, plan.decode_computed = pack_int32([1]), pack_int32([8])
    rows, counts = np.array([10, 11, 12, 13]), np.array([4, 1, 1, 1])
    kept_rows, kept_counts = failures.kept(plan, rows, counts)
    assert kept_rows.tolist() == [10, 12] and kept_counts.tolist() == [4, 1], "requests 3 and 1 are left out"

    failures.forget(1)
    failures.forget(3)
    assert not failures and failures.kept(plan, rows, counts)[0].tolist() == rows.tolist()
