"""The decode CUDA-graph path's padding, checked on CPU: the same static, padded buffers a captured graph
replays (batch padded to the nearest size with slot -1 tokens, block tables padded to a fixed width), run
eagerly through the Triton kernels in the interpreter, must give the tokens the plain path gives. With LoRA: the
graph path's slot bank and static slot-index buffer, for a batch mixing two adapters and base rows, give each
request the eager path's tokens and HF + PEFT's; a slot reloaded with another adapter is written in place."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from proto.lora import BaseShapes  # noqa: E402
from scheduler_node.engine.lora_registry import LoraRegistry  # noqa: E402
from tests.support.engine import EngineRun, generate, load_runner  # noqa: E402
from tests.support.lora import load_base, load_peft_many, make_adapters  # noqa: E402
from tests.support.models import assert_teacher_forced, load_hf  # noqa: E402
from worker_node.cuda_graphs import DecodeGraphs, parse_sizes  # noqa: E402
from worker_node.lora.manager import LoraManager  # noqa: E402
from worker_node.lora.slot_bank import LoraCapacity  # noqa: E402
from worker_node.model_runner import ModelRunner  # noqa: E402
from worker_node.models.attention import AttentionMetadata  # noqa: E402

pytestmark = pytest.mark.model

LENGTHS = [3, 18, 9]
MAX_TOKENS = [5, 4, 6]


def test_padded_decode_buffers_give_the_same_tokens(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]
    plain, _ = generate(tiny_llama_dir, load_runner(tiny_llama_dir, 12, 16, "triton"), prompts, MAX_TOKENS)

    runner = load_runner(tiny_llama_dir, 12, 16, "triton")
    graphs = DecodeGraphs(runner.model, runner.kv_cache, [2, 4], 6, 64, runner.dtype, runner.device, False, False)
    used: list[int] = []
    run = graphs.run

    def run_and_note(
        ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None, *lora: Any
    ) -> torch.Tensor:
        used.append(ids.shape[0])
        return run(ids, positions, meta, hidden, *lora)

    monkeypatch.setattr(graphs, "run", run_and_note)
    runner.graphs = graphs
    padded, _ = generate(tiny_llama_dir, runner, prompts, MAX_TOKENS)

    assert 3 in used and 1 in used, used  # batches of 3 (padded to 4) and of 1 (padded to 2) took the path
    hf = load_hf(tiny_llama_dir)
    for prompt, a, b in zip(prompts, plain, padded):
        assert b == a
        assert_teacher_forced(hf, prompt, b)


def _lora_run(folder: Path, runner: ModelRunner, refs: list, prompts: list, loras: list) -> list[list[int]]:  # type: ignore[type-arg]
    """Greedy tokens; the first request runs longest, so later decode steps hold it with the others."""
    with EngineRun(runner, tokenizer_dir=folder, max_loras=2) as run:
        requests = [
            run.add(p, 5 if j == 0 else 3, lora=None if i is None else refs[i])
            for j, (p, i) in enumerate(zip(prompts, loras))
        ]
        run.run()
    return [r.output for r in requests]


def test_decode_graph_buffers_with_adapter_rows_give_each_request_its_adapters_tokens(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = load_base(tiny_llama_dir)
    paths = make_adapters(base, tmp_path, 3, seed=60, rank=4)
    registry = LoraRegistry(BaseShapes.from_folder(tiny_llama_dir), max_rank=4)
    refs = [registry.add(f"a{i}", str(p)) for i, p in enumerate(paths)]
    prompts, loras = [[5, 6, 7], [11, 12], [5, 6, 7], [9, 8, 7, 6], [11, 12]], [0, None, 1, 1, None]
    eager = _lora_run(tiny_llama_dir, load_runner(tiny_llama_dir, 16, 16), refs, prompts, loras)  # torch, compact

    runner = load_runner(tiny_llama_dir, 16, 16, "triton")
    runner.lora = LoraManager(runner.model, runner.dtype, runner.device, LoraCapacity(max_loras=2, max_rank=4))
    # Its updates here: the bank's branch-free torch form (the interpreter would take minutes over every step);
    # the Triton kernel a GPU captures, over a bank, is tests/kernels/test_triton_lora.py's.
    assert runner.lora.bank is not None
    graphs = DecodeGraphs(
        runner.model, runner.kv_cache, [2, 8], 2, 64, runner.dtype, runner.device, False, False, lora=runner.lora
    )
    used: list[tuple[int, ...]] = []  # each graph-path batch's slots (-1: base rows)
    run = graphs.run

    def run_and_note(*args: Any) -> torch.Tensor:
        used.append(tuple(sorted(set(args[4].tolist()))) if args[4] is not None else (-1,))
        return run(*args)

    monkeypatch.setattr(graphs, "run", run_and_note)
    runner.graphs = graphs
    padded = _lora_run(tiny_llama_dir, runner, refs, prompts, loras)
    assert (-1, 0, 1) in used, used  # a batch of both adapters and base rows (padded to 8) took the graph path

    bank = runner.lora.bank.projections
    pointers = {k: (p.a.data_ptr(), p.b.data_ptr(), p.widths.data_ptr()) for k, p in bank.items()}
    before = bank[(0, "qkv_proj")].a.clone()
    # Adapter 2 takes a slot adapter 0 or 1 held: loaded in place, and its request gets adapter 2's tokens.
    again = _lora_run(tiny_llama_dir, runner, refs, [[5, 6, 7]], [2])
    assert {k: (p.a.data_ptr(), p.b.data_ptr(), p.widths.data_ptr()) for k, p in bank.items()} == pointers
    assert not torch.equal(bank[(0, "qkv_proj")].a, before)
    assert refs[2].id in [r.id for r in runner.lora.slots.values()] and again[0] != padded[0]

    assert padded == eager
    reference = load_peft_many(base, paths)
    for prompt, lora, tokens in [*zip(prompts, loras, padded), ([5, 6, 7], 2, again[0])]:
        if lora is None:
            assert_teacher_forced(base, prompt, tokens)
        else:
            reference.set_adapter(str(lora))
            assert_teacher_forced(reference, prompt, tokens)


def test_parse_sizes() -> None:
    assert parse_sizes("8,1, 2,2") == [1, 2, 8] and parse_sizes("") == []
    with pytest.raises(ValueError):
        parse_sizes("0,4")
