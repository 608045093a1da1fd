"""LoRA: greedy output with each request's adapter is HF + PEFT's argmax at every position (teacher-forced), in
batches mixing adapters and the base model, through slot eviction."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from proto.lora import BaseShapes
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.engine.lora_registry import LoraRegistry
from tests.support.engine import EngineRun, load_runner
from tests.support.inprocess_tp import TensorParallelRanks
from tests.support.lora import load_base, load_peft, load_peft_many, make_adapter, make_adapters, make_peft_many
from tests.support.models import assert_teacher_forced
from tests.support.quant import hf_on_dequantized
from worker_node.models.quantize import make_method

pytestmark = pytest.mark.model

BLOCK = 16
# (targets, rank, rslora): every module; attention's q and v only (parts of the fused qkv); MLP with rsLoRA.
ADAPTERS = [
    (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 8, False),
    (("q_proj", "v_proj"), 4, False),
    (("gate_proj", "down_proj", "k_proj"), 16, True),
    (("o_proj", "up_proj"), 2, False),
]


@pytest.fixture(scope="module")
def base_model(tiny_llama_dir: Path) -> Any:
    return load_base(tiny_llama_dir)


@pytest.fixture(scope="module")
def adapters(base_model: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("loras")
    return [
        make_adapter(base_model, root / f"a{i}", seed=i, rank=r, targets=t, rslora=rs)
        for i, (t, r, rs) in enumerate(ADAPTERS)
    ]


@pytest.fixture(scope="module")
def references(base_model: Any, adapters: list[Path]) -> dict[int | None, Any]:
    """HF's model for the base (None) and HF + PEFT's for each adapter."""
    models: dict[int | None, Any] = {None: base_model}
    models.update({i: load_peft(base_model, path) for i, path in enumerate(adapters)})
    return models


def _refs(folder: Path, adapters: list[Path]) -> list[LoraRef]:
    registry = LoraRegistry(BaseShapes.from_folder(folder), max_rank=16)
    return [registry.add(f"lora{i}", str(a)) for i, a in enumerate(adapters)]


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.choice([3, 17, 30]))] for _ in range(n)]


def _check(models: dict[int | None, Any], requests: list, prompts: list, loras: list) -> None:  # type: ignore[type-arg]
    for req, prompt, lora in zip(requests, prompts, loras):
        assert_teacher_forced(models[lora], prompt, req.output)


def test_mixed_batch_of_adapters_and_base_matches_peft(
    tiny_llama_dir: Path, adapters: list[Path], references: dict[int | None, Any]
) -> None:
    refs = _refs(tiny_llama_dir, adapters)
    prompts = _prompts(3, 10)
    loras = [None, 0, 1, 2, 3, 0, None, 3, 1, 2]  # every adapter and the base model in one batch
    runner = load_runner(tiny_llama_dir, 64, BLOCK)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_loras=4, max_num_batched_tokens=64) as run:
        requests = [run.add(p, 12, lora=None if i is None else refs[i]) for p, i in zip(prompts, loras)]
        run.run()
        # One adapter of the four resident: its own columns of the stacks, not the whole stacks.
        extra = _prompts(6, 2)
        requests += [run.add(p, 12, lora=refs[2]) for p in extra]
        prompts, loras = prompts + extra, loras + [2, 2]
        run.run()
        assert run.scheduler.blocks.num_free == 64
    assert runner.lora is not None and runner.lora.loads == 4
    outputs = {tuple(r.output) for r in requests[1:6]}
    assert len(outputs) == 5, "adapters with the same prompt gave the same tokens: an adapter had no effect"
    _check(references, requests, prompts, loras)


def test_slots_evicted_and_reloaded_keep_tokens_right(
    tiny_llama_dir: Path, adapters: list[Path], references: dict[int | None, Any]
) -> None:
    """Four adapters through two slots: requests wait for a slot while the base model's and others run."""
    refs = _refs(tiny_llama_dir, adapters)
    prompts = _prompts(4, 14)
    loras = [0, 1, 2, 3, None, 2, 0, 3, 1, None, 0, 2]
    runner = load_runner(tiny_llama_dir, 64, BLOCK)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_loras=2) as run:
        requests = [run.add(p, 8, lora=None if i is None else refs[i]) for p, i in zip(prompts, loras)]
        run.run()
        loras += [0, 1]  # evicted by 2 and 3 since: loaded again
        requests += [run.add(p, 8, lora=refs[i]) for p, i in zip(prompts[12:], (0, 1))]
        run.run()
        assert run.scheduler.blocks.num_free == 64
        assert run.scheduler.view.lora_slots.pinned == 0  # nothing leaks a slot
    assert runner.lora is not None
    assert len(runner.lora.slots) == 2 and runner.lora.loads == 6
    _check(references, requests, prompts, loras)


def test_tensor_parallel_shards_adapters_like_their_layers(
    tiny_llama_dir: Path, adapters: list[Path], references: dict[int | None, Any]
) -> None:
    """TP 2: B's output rows of q/k/v and gate/up, A's input columns of o and down, per rank."""
    refs = _refs(tiny_llama_dir, adapters)
    prompts = _prompts(5, 5)
    loras = [0, 1, 2, 3, None]
    tp2 = TensorParallelRanks(tiny_llama_dir, 64, BLOCK, tp=2)
    try:
        with EngineRun(tp2.runners, tokenizer_dir=tiny_llama_dir, transport=tp2.transport(), max_loras=4) as run:
            requests = [run.add(p, 10, lora=None if i is None else refs[i]) for p, i in zip(prompts, loras)]
            run.run()
    finally:
        tp2.close()
    _check(references, requests, prompts, loras)


def test_adapters_compose_with_a_quantized_base(tiny_llama_dir: Path, adapters: list[Path]) -> None:
    """int8 projections (QuantLinear): each adapter's update adds to the quantized layer's output, as PEFT's adds to
    HF's model on the same dequantized weights."""
    refs = _refs(tiny_llama_dir, adapters)
    prompts = _prompts(7, 3)
    loras = [0, 2, None]
    runner = load_runner(tiny_llama_dir, 64, BLOCK, quantization="int8")
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_loras=2) as run:
        requests = [run.add(p, 10, lora=None if i is None else refs[i]) for p, i in zip(prompts, loras)]
        run.run()
    base = hf_on_dequantized(tiny_llama_dir, make_method("int8", runner.device))
    models = {None: base, 0: load_peft(base, adapters[0]), 2: load_peft(base, adapters[2])}
    _check(models, requests, prompts, loras)


@pytest.fixture(scope="module")
def eight(base_model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Any]:
    """Eight adapters of rank 4 (every module), and one HF + PEFT model holding them all."""
    paths = make_adapters(base_model, tmp_path_factory.mktemp("eight"), 8, seed=100)
    return paths, load_peft_many(base_model, paths)


def test_eight_adapters_cycled_through_two_slots_under_load_and_reloaded_at_run_time(
    tiny_llama_dir: Path, eight: tuple[list[Path], Any]
) -> None:
    """32 streams over 8 adapters and --max-loras 2 (--max-cpu-loras 3): half of the adapters are unloaded and
    loaded again (new ids: new weights for the workers) while the first 16 streams run; every stream's tokens are
    its adapter's, and at idle no KV block, no slot pin leaks."""
    paths, reference = eight
    registry = LoraRegistry(BaseShapes.from_folder(tiny_llama_dir), max_rank=16)
    refs = [registry.add(f"e{i}", str(p)) for i, p in enumerate(paths)]
    prompts = _prompts(8, 32)
    # Four adapters in turn through two slots (and three host places: each comes back from host memory), then
    # the other four, twice over.
    which = [i % 4 + 4 * (i // 8 % 2) for i in range(32)]
    runner = load_runner(tiny_llama_dir, 64, BLOCK)
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_loras=2, max_cpu_loras=3) as run:
        run.engine.loras = registry
        requests = [run.add(p, 6, lora=refs[i]) for p, i in zip(prompts[:16], which)]
        run.run_plans(4)  # under load: some streams run, others wait for a slot
        for i in range(4):  # unloaded (running streams keep it), then loaded again under a new id
            registry.remove(f"e{i}")
            refs[i] = registry.add(f"e{i}", str(paths[i]))
        requests += [run.add(p, 6, lora=refs[i]) for p, i in zip(prompts[16:], which[16:])]
        run.run()
        assert runner.lora is not None and runner.lora.loads == 12 and runner.lora.host_loads == 0
        kept = run.scheduler.view.lora_slots.in_host()
        assert list(runner.lora.host) == kept and len(kept) == 3  # the workers' host tier is the mirrored one
        back = [next(i for i, r in enumerate(refs) if r.id == lora_id) for lora_id in kept[:2]]
        requests += [run.add(p, 6, lora=refs[i]) for p, i in zip(_prompts(9, 2), back)]
        prompts, which = prompts + _prompts(9, 2), which + back
        run.run()
        assert (runner.lora.loads, runner.lora.host_loads) == (12, 2), "not taken back from host memory"
        assert run.scheduler.blocks.num_free == 64
        assert run.scheduler.view.lora_slots.pinned == 0
        assert [m.adapters for m in run.engine.lora_memory()] == [2, 3]
    assert len(runner.lora.slots) == 2 and len(runner.lora.host) == 3
    for req, prompt, i in sorted(zip(requests, prompts, which), key=lambda x: x[2]):
        assert len(req.output) == 6
        reference.set_adapter(str(i))
        assert_teacher_forced(reference, prompt, req.output)


# Mixtral's MLP is a mixture of experts: its adapters adapt attention only (proto/lora.py refuses the others).
ATTENTION_ADAPTERS = [
    (("q_proj", "k_proj", "v_proj", "o_proj"), 8, False),
    (("q_proj", "v_proj"), 4, False),
    (("k_proj", "o_proj"), 16, True),
    (("v_proj",), 2, False),
]


@pytest.mark.parametrize(("kind", "tp"), [("qwen2", 1), ("mixtral", 1), ("qwen2", 2), ("mixtral", 2)])
def test_other_architectures_mix_four_adapters_and_the_base_model(
    kind: str, tp: int, tiny_model_dir: Any, tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    """Qwen2 (q/k/v biases: the adapter adds to the biased projection) and Mixtral (attention adapters over an MoE
    model), at TP 1 and TP 2: each request's tokens are its adapter's in a batch mixing four adapters and the base
    model."""
    folder = tiny_qwen2_dir if kind == "qwen2" else tiny_model_dir(kind)
    base = load_base(folder)
    specs = ADAPTERS if kind == "qwen2" else ATTENTION_ADAPTERS
    paths = [make_adapter(base, tmp_path / f"a{i}", seed=20 + i, rank=r, targets=t, rslora=rs)
             for i, (t, r, rs) in enumerate(specs)]  # fmt: skip
    reference = load_peft_many(base, paths)
    refs = _refs(folder, paths)
    prompts = _prompts(11, 4) * 2  # each prompt twice, with two different adapters (or one and the base model)
    loras = [None, 0, 1, 2, 0, 1, 2, 3]
    ranks = TensorParallelRanks(folder, 64, BLOCK, tp=2) if tp == 2 else None
    runners = ranks.runners if ranks is not None else load_runner(folder, 64, BLOCK)
    transport = ranks.transport() if ranks is not None else None
    try:
        with EngineRun(
            runners, tokenizer_dir=folder, max_loras=4, max_num_batched_tokens=64, transport=transport
        ) as run:
            requests = [run.add(p, 6, lora=None if i is None else refs[i]) for p, i in zip(prompts, loras)]
            run.run()
            assert run.scheduler.blocks.num_free == 64
    finally:
        if ranks is not None:
            ranks.close()
    for first, again in zip(requests[:4], requests[4:]):
        assert first.output != again.output, "two adapters gave the same tokens: an adapter had no effect"
    for req, prompt, lora in zip(requests, prompts, loras):
        if lora is None:
            assert_teacher_forced(base, prompt, req.output)
        else:
            reference.set_adapter(str(lora))
            assert_teacher_forced(reference, prompt, req.output)


def test_smollm2_mixes_two_adapters_and_the_base_model(smollm2_dir: Path, tmp_path: Path) -> None:
    """The real SmolLM2 (fp32): two random adapters (every module; attention's q/v with rsLoRA) and the base model
    in one batch of text prompts; every greedy token is HF + PEFT's teacher-forced argmax."""
    from scheduler_node.text.tokenizer import ModelTokenizer

    paths, reference = make_peft_many(smollm2_dir, tmp_path, [ADAPTERS[0], (("q_proj", "v_proj"), 4, True)], 40)
    tok = ModelTokenizer(smollm2_dir)
    texts = ["The capital of France is", "def fibonacci(n):"]
    prompts = [tok.encode(t) for t in texts for _ in range(2)]
    loras = [None, 0, 1, 0]
    refs = _refs(smollm2_dir, paths)
    with EngineRun(load_runner(smollm2_dir, 64, BLOCK), tokenizer_dir=smollm2_dir, max_loras=2) as run:
        requests = [run.add(p, 4, lora=None if i is None else refs[i]) for p, i in zip(prompts, loras)]
        run.run()
        assert run.scheduler.blocks.num_free == 64
    for first, other in zip(requests[::2], requests[1::2]):  # each prompt twice: two adapters, or one and the base
        assert first.output != other.output, "an adapter did not change the tokens"
    for req, prompt, lora in zip(requests, prompts, loras):
        if lora is None:
            with reference.disable_adapter():
                assert_teacher_forced(reference, prompt, req.output)
        else:
            reference.set_adapter(f"a{lora}")
            assert_teacher_forced(reference, prompt, req.output)
