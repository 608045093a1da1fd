"""The C runner of a decode step's layers (worker_node/models/native_decode.py) against the Python layers: the same
kernel calls in the same order, so a mixed batch's tokens and logprobs are equal to the last bit, in every weight
format it takes; and it steps aside where it does not apply (LoRA, a quantized KV cache, more rows than the
kernels take)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import cpu_gemm
from kernels.cpu_decode_layers import PHASES
from minivllm import LLM, LoRARequest, SamplingParams
from tests.support.awq_checkpoint import write_awq_checkpoint
from tests.support.lora import load_base, make_adapter
from worker_node.models import native_decode

pytestmark = pytest.mark.model

PROMPTS = [[5 + i * 7 + j for j in range(n)] for i, n in enumerate([3, 11, 1, 24, 6])]  # a mixed batch


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("awq-native") / "model"
    write_awq_checkpoint(tiny_llama_dir, folder, group=32)
    return folder


def generate(
    monkeypatch: pytest.MonkeyPatch,
    folder: Path,
    native: bool,
    prompts: list[list[int]] = PROMPTS,
    *,
    lora: LoRARequest | None = None,
    **engine: Any,
) -> tuple[list[tuple[list[int], list[float]]], int]:
    """Each prompt's greedy tokens and their logprobs, and how many steps the C runner ran."""
    ran = 0
    run = native_decode.NativeDecode.run

    def counted(self: native_decode.NativeDecode, *args: Any) -> Any:
        nonlocal ran
        out = run(self, *args)
        ran += out is not None
        return out

    monkeypatch.setattr(native_decode.NativeDecode, "run", counted)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(str(folder), dtype="bfloat16", num_kv_blocks=256, native_decode=native, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    results = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        results.append((list(c.token_ids), [lp.logprob for lp in c.logprobs]))
    return results, ran


@pytest.fixture
def amx() -> None:
    if cpu_gemm.load() is None:
        pytest.skip("the runner takes the C matmul kernels' calls (AMX, AVX-512 BF16 or AVX2): this CPU has none")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "awq"])
def test_the_runner_gives_the_python_layers_tokens_and_logprobs_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, amx: None, tiny_llama_dir: Path, awq_dir: Path, fmt: str
) -> None:
    folder = awq_dir if fmt == "awq" else tiny_llama_dir
    engine: dict[str, Any] = {"quantization": fmt} if fmt in ("int8", "fp8") else {}
    python, none_ran = generate(monkeypatch, folder, False, **engine)
    native, ran = generate(monkeypatch, folder, True, **engine)
    assert none_ran == 0 and ran >= 11, ran  # every decode step of the 12 tokens but the prefill's
    assert native == python


def test_under_the_profile_switch_every_phase_of_every_step_adds_up(
    monkeypatch: pytest.MonkeyPatch, amx: None, tiny_llama_dir: Path
) -> None:
    """--decode-phases (settings/fast_paths.py): the runners made from then on time their phases
    (scripts/bench_decode_phases.py); off, none does (the clock reads cost a step time)."""
    before = native_decode.phase_seconds()
    _, ran = generate(monkeypatch, tiny_llama_dir, True)
    assert ran >= 11 and torch.equal(native_decode.phase_seconds(), before), "off by default: nothing timed"
    _, ran = generate(monkeypatch, tiny_llama_dir, True, decode_phases=True)
    added = native_decode.phase_seconds() - before
    assert ran >= 11 and added.shape == (len(PHASES),) and bool((added > 0).all()), added


def test_it_steps_aside_for_a_quantized_cache_lora_and_more_rows_than_the_kernels_take(
    monkeypatch: pytest.MonkeyPatch, amx: None, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _, ran = generate(monkeypatch, tiny_llama_dir, True, kv_cache_dtype="int8")
    assert ran == 0, "an int8 cache: the Python layers"
    many = [[3 + i, 9 + i] for i in range(native_decode.MAX_ROWS + 6)]
    python, _ = generate(monkeypatch, tiny_llama_dir, False, many, max_num_seqs=128)
    native, ran = generate(monkeypatch, tiny_llama_dir, True, many, max_num_seqs=128)
    assert native == python and ran == 0, "70 rows per step: the Python layers"
    adapter = LoRARequest("a", 1, str(make_adapter(load_base(tiny_llama_dir), tmp_path / "a", seed=3, rank=4)))
    lora: dict[str, Any] = {"enable_lora": True, "max_loras": 1}
    python, _ = generate(monkeypatch, tiny_llama_dir, False, PROMPTS[:2], lora=adapter, **lora)
    native, ran = generate(monkeypatch, tiny_llama_dir, True, PROMPTS[:2], lora=adapter, **lora)
    assert native == python and ran == 0, "LoRA hooks on the projections: the Python layers"
