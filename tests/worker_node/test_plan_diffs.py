"""A plan's diffs on a ModelRunner (worker_node/plan_diffs.py) around a model that costs nothing: packed steady
decodes find their rows, and a plan that names a request the worker does not hold, or says another count of
computed tokens than the worker has, is refused with an error naming the request (a StepError on the wire), not
run on some other row. A new request's LoRA adapter that cannot be read faults exactly the requests naming it
(the tiny Llama), leaving the batch as the scheduler counts it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from proto.lora import BaseShapes
from proto.wire import LoraAdapter, NewRequest, SamplingOptions, StepPlan, pack_int32
from scheduler_node.core.lora_slots import LoraSlots
from scheduler_node.engine.lora_registry import LoraRegistry
from tests.support.engine import load_runner
from tests.support.lora import write_adapter
from worker_node.faults import RequestFault
from worker_node.kv.cache import LayerKV
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


def _cut(folder: Path) -> None:
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_cut, shutil.rmtree])
def test_an_adapter_unreadable_at_first_use_faults_exactly_the_requests_naming_it(
    tiny_llama_dir: Path, tmp_path: Path, damage: object
) -> None:
    base = BaseShapes.from_folder(tiny_llama_dir)
    registry = LoraRegistry(base, max_rank=8)
    folders = {name: write_adapter(tmp_path / name, base, rank=8, seed=i) for i, name in enumerate(("good", "bad"))}
    refs = {name: registry.add(name, str(folder)) for name, folder in folders.items()}
    slots = LoraSlots(2)
    wire: dict[str | None, LoraAdapter | None] = {None: None} | {n: slots.pin(r) for n, r in refs.items()}
    assert callable(damage)
    damage(tmp_path / "bad")  # after registering: it loaded with 200
    names = {1: None, 2: "good", 3: "bad", 4: None, 5: "bad", 6: None}
    greedy = SamplingOptions(temperature=0.0)

    def plan(step_id: int, handles: list[int]) -> StepPlan:
        p = StepPlan(step_id)
        p.new_requests = [NewRequest(h, [300 + h] * 5, [], greedy, [h], 0, 5, lora=wire[names[h]]) for h in handles]
        return p

    runner = load_runner(tiny_llama_dir, 16, 16)
    with pytest.raises(RequestFault) as fault:
        runner.execute(plan(1, list(names)))
    assert fault.value.handles == [3, 5] and fault.value.adapters == [2]
    assert fault.value.reason.startswith("LoRA adapter 'bad' (id 2) cannot be used: ")
    assert str(tmp_path) not in fault.value.reason
    assert runner.batch.states == {}  # no new request joined the batch: nothing half-added to forget

    innocent = [h for h, name in names.items() if name != "bad"]  # the engine's retry, on the same worker
    got = list(runner.execute(plan(2, innocent)).sampled_items())
    want = list(load_runner(tiny_llama_dir, 16, 16).execute(plan(2, innocent)).sampled_items())  # never faulted
    assert got == want and len(got) == len(innocent)
