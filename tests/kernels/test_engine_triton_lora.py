"""The engine with its LoRA updates computed by the Triton kernels (kernels/triton_lora.py, what a GPU worker runs)
in Triton's interpreter (TRITON_INTERPRET=1, conftest): two adapters and the base model in one batch, each
request's tokens HF + PEFT's. The batch is tiny: the interpreter runs every program in Python."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from kernels.triton_lora import lora_add  # noqa: E402
from proto.lora import BaseShapes  # noqa: E402
from scheduler_node.engine.lora_registry import LoraRegistry  # noqa: E402
from tests.support.engine import EngineRun, load_runner  # noqa: E402
from tests.support.lora import load_base, load_peft_many, make_adapters  # noqa: E402
from tests.support.models import assert_teacher_forced  # noqa: E402

pytestmark = pytest.mark.model


def test_triton_lora_kernels_give_each_request_its_adapters_tokens(tiny_llama_dir: Path, tmp_path: Path) -> None:
    base = load_base(tiny_llama_dir)
    paths = make_adapters(base, tmp_path, 2, seed=40, rank=8)
    registry = LoraRegistry(BaseShapes.from_folder(tiny_llama_dir), max_rank=8)
    refs = [registry.add(f"a{i}", str(p)) for i, p in enumerate(paths)]
    runner = load_runner(tiny_llama_dir, 16, 16)
    calls = []

    def kernel(*args, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return lora_add(*args, **kw)

    runner.lora_manager()._kernel = kernel  # what a CUDA worker picks
    prompts, loras = [[5, 6, 7], [11, 12], [5, 6, 7]], [0, None, 1]
    with EngineRun(runner, tokenizer_dir=tiny_llama_dir, max_loras=2) as run:
        requests = [run.add(p, 3, lora=None if i is None else refs[i]) for p, i in zip(prompts, loras)]
        run.run()
    assert calls, "the kernels did not run"
    assert requests[0].output != requests[2].output
    reference = load_peft_many(base, paths)
    for req, prompt, lora in zip(requests, prompts, loras):
        if lora is None:
            assert_teacher_forced(base, prompt, req.output)
        else:
            reference.set_adapter(str(lora))
            assert_teacher_forced(reference, prompt, req.output)
