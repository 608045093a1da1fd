"""A plan's diffs on a ModelRunner (worker_node/plan_diffs.py) around a model that costs nothing: packed steady
decodes find their rows, and a plan that names a request the worker does not hold, or says another count of
computed tokens than the worker has, is refused with an error naming the request (a StepError on the wire), not
run on some other row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from proto.wire import NewRequest, SamplingOptions, StepPlan, pack_int32
from worker_node.kv_cache import LayerKV
from worker_node.model_runner import ModelRunner
from worker_node.plan_diffs import PlanDiffs
from worker_node.stand_in import zero_cost_loader

pytestmark = pytest.mark.model  # the stand-in model: no weights, no compute


def _runner(folder: Path) -> ModelRunner:
    model = zero_cost_loader(1024)(folder, None, torch.float32, torch.device("cpu"))
    kv = [LayerKV(torch.zeros(64, 16, 1, 1), torch.zeros(64, 16, 1, 1))]  # the stand-in never reads it
    return ModelRunner(model, kv, 16, torch.device("cpu"))  # type: ignore[arg-type]  # a stand-in for CausalLM


def _decodes(step_id: int, handles: list[int], computed: list[int]) -> StepPlan:
    plan = StepPlan(step_id)
    plan.decode_handles, plan.decode_computed = pack_int32(handles), pack_int32(computed)
    return plan


def test_packed_decodes_run_on_their_rows_and_unknown_or_wrong_ones_are_refused(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir)
    assert isinstance(runner.diffs, PlanDiffs)
    first = StepPlan(1)
    first.new_requests = [
        NewRequest(h, [300 + h] * 5, [], SamplingOptions(temperature=0.0), [h], 0, 5) for h in (4, 9, 2)
    ]
    tokens = runner.execute(first).sampled_items()
    after = {h: [t] for h, t in tokens}
    assert sorted(after) == [2, 4, 9]
    result = runner.execute(_decodes(2, [9, 2, 4], [5, 5, 5]))  # in another order than they came
    assert [h for h, _ in result.sampled_items()] == [9, 2, 4]
    assert [runner.computed_tokens(h) for h in (2, 4, 9)] == [6, 6, 6]
    with pytest.raises(ValueError, match="request 7: a cached request this worker does not hold"):
        runner.apply_diffs(_decodes(3, [2, 7], [6, 6]))
    with pytest.raises(RuntimeError, match="request 4: worker has 6 computed tokens, plan says 5"):
        runner.apply_diffs(_decodes(3, [2, 4], [6, 5]))
