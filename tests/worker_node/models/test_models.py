"""Every supported architecture gives HF transformers' greedy tokens (teacher-forced, fp32) on a tiny random
model that HF builds and saves itself, alone (TP 1) and split over two tensor-parallel ranks (TP 2).

The tiny configs make each feature count (tests/support/models.py: TINY_KINDS, TINY_VARIANTS): sliding windows
shorter than the
prompts, soft-caps that bite, norm weights off their init. Prompts cross those windows and 16-token blocks, and
a 16-token budget chunks the prefills. TP 2 runs two ranks in one process over gloo (tests/support/inprocess_tp.py); the
MoE also runs as real worker processes behind the gRPC server.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minivllm.tiny_models import TINY_VARIANTS
from scheduler_node.engine.builder import model_limit
from tests.e2e.test_parallel import World
from tests.support.engine import EngineRun, load_runner
from tests.support.inprocess_tp import TensorParallelRanks
from tests.support.models import assert_same_logprobs, assert_teacher_forced, load_hf
from worker_node.inprocess import InProcessWorkers
from worker_node.model_runner import ModelRunner
from worker_node.models.decoder import CausalLM
from worker_node.models.layers import Attention, RMSNorm, Rotary
from worker_node.models.mixtral import SparseMoE

pytestmark = pytest.mark.model

LENGTHS = [5, 17, 40]
MAX_TOKENS = [24, 12, 30]
NUM_BLOCKS = 24
BLOCK = 16
BUDGET = 16  # max_num_batched_tokens: chunked prefills mixed with decodes


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]


MODELS = list(TINY_VARIANTS)  # each new architecture, and Mistral with a window shorter than the requests


def generate(folder: Path, runners: list[ModelRunner], transport: InProcessWorkers | None = None) -> list[list[int]]:
    with EngineRun(runners, tokenizer_dir=folder, transport=transport, max_num_batched_tokens=BUDGET) as run:
        submitted = [run.add(p, m) for p, m in zip(prompts(), MAX_TOKENS)]
        run.run()
        assert run.scheduler.blocks.num_free == NUM_BLOCKS
    return [s.output for s in submitted]


@pytest.mark.parametrize("name", MODELS)
def test_matches_hf_alone_and_tensor_parallel(name: str, tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir(name)
    runner = load_runner(folder, NUM_BLOCKS, BLOCK)
    alone = generate(folder, [runner])
    tp2 = TensorParallelRanks(folder, NUM_BLOCKS, BLOCK, tp=2)
    try:
        split = generate(folder, tp2.runners, tp2.transport())
    finally:
        tp2.close()
    hf = load_hf(folder)
    for i, (prompt, out) in enumerate(zip(prompts(), alone)):
        assert len(out) == MAX_TOKENS[i]
        assert_teacher_forced(hf, prompt, out)
        assert split[i] == out, f"prompt {i}: TP 2 {split[i]} != TP 1 {out}"
    assert_same_logprobs(hf, runner, prompts()[-1] + alone[-1])


def _attention(model: CausalLM) -> list[Attention]:
    attention = []
    for layer in model.layers:
        assert isinstance(layer.self_attn, Attention), f"{type(layer).__name__} keeps its Attention in self_attn"
        attention.append(layer.self_attn)
    return attention


def _set_each(objects: Iterable[object], name: str, value: object) -> None:
    for target in objects:
        setattr(target, name, value)


def _unscaled_queries(model: CausalLM, _: pytest.MonkeyPatch) -> None:
    for attention in _attention(model):
        attention.scale = attention.head_dim**-0.5


def _without_renormalisation(self: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    top_weights, top_experts = torch.topk(torch.softmax(self.gate(x).float(), dim=-1), self.top_k, dim=-1)
    return self.comm.all_reduce(self.experts(x, top_experts, top_weights))


# Each feature of an architecture, taken away from our loaded model.
WITHOUT: dict[str, Callable[[CausalLM, pytest.MonkeyPatch], object]] = {
    "gemma2: attention soft-cap": lambda m, _: _set_each(_attention(m), "softcap", 0.0),
    "gemma2: sliding window": lambda m, _: _set_each(_attention(m), "window", 0),
    "gemma2: final soft-cap": lambda m, _: setattr(m.lm_head, "softcap", 0.0),
    "gemma2: embedding scale": lambda m, _: setattr(m.embed_tokens, "scale", 1.0),
    "gemma2: 1 + w norms": lambda m, _: _set_each((n for n in m.modules() if isinstance(n, RMSNorm)), "offset", 0.0),
    "gemma2: query_pre_attn_scalar": _unscaled_queries,
    "gemma2: tanh GELU": lambda m, _: _set_each((layer.mlp for layer in m.layers), "act", F.silu),
    "qwen3: q/k norms": lambda m, _: _set_each(_attention(m), "q_norm", None),
    "phi3: sliding window": lambda m, _: _set_each(_attention(m), "window", 0),
    "phi3: partial RoPE": lambda m, _: setattr(
        m, "rotary", Rotary(dataclasses.replace(m.config, rotary_dim=m.config.head_dim), 1024)
    ),
    "mistral-window: sliding window": lambda m, _: _set_each(_attention(m), "window", 0),
    "mixtral: top-2 routing": lambda m, _: _set_each((layer.block_sparse_moe for layer in m.layers), "top_k", 1),
    "mixtral: renormalised weights": lambda m, mp: mp.setattr(SparseMoE, "forward", _without_renormalisation),
}


@pytest.mark.parametrize("feature", list(WITHOUT))
def test_each_feature_counts(
    feature: str, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: without any one feature the log-probabilities are no longer HF's."""
    folder = tiny_model_dir(feature.split(":")[0])
    runner = load_runner(folder, NUM_BLOCKS, BLOCK)
    WITHOUT[feature](runner.model, monkeypatch)
    with pytest.raises(AssertionError, match="log-probabilities differ"):
        assert_same_logprobs(load_hf(folder), runner, prompts()[-1])


def test_mistral_context_is_not_capped_at_its_window(tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir("mistral-window")
    config = json.loads((folder / "config.json").read_text())
    assert config["sliding_window"] < max(n + m for n, m in zip(LENGTHS, MAX_TOKENS))
    assert model_limit(folder) == config["max_position_embeddings"]


def test_moe_tensor_parallel_worker_processes(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """The MoE split over two real worker processes behind the gRPC server: each rank holds half of every
    expert's intermediate dim."""
    folder = tiny_model_dir("mixtral")
    world = World(folder, ["--tensor-parallel-size", "2"], [[], []], tmp_path)
    try:
        world.wait_serving()
        outputs = world.generate(prompts(), MAX_TOKENS)
    finally:
        world.kill_all()
    hf = load_hf(folder)
    for prompt, out, wanted in zip(prompts(), outputs, MAX_TOKENS):
        assert len(out) == wanted
        assert_teacher_forced(hf, prompt, out)
