"""The design article's custom-kernel lines (§6.2, §4.3) run as written, `vllm` read as `minivllm`, against the
example library of deploy/ compiled here: registered by name, checked by `PagedAttention.supports`, then serving a
tiny model in this process and in worker processes, its greedy tokens the built-in backend's; and the refusals an
`LLM` gives before any worker starts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernels import custom_kernels
from minivllm import LLM, SamplingParams, _custom_ops
from tests.seeds.blocks import block
from tests.support.custom_kernel import build_example, counter

pytestmark = pytest.mark.e2e

# §6.2 and §4.3, as the article writes them (but for the package's name): tests/seeds/blocks.py.
REGISTER = block("register_kernel").text
CHECK = block("paged_attention_supports").text
PROMPTS = [[5, 9, 13], list(range(20, 57)), [101] * 18]  # prefill chunks, block boundaries, a repeated prompt
MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(custom_kernels, "_registry", {})
    yield


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_example(tmp_path_factory.mktemp("kernel"))


def greedy(folder: Path, **settings: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        str(folder), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=24, threads=1, **settings
    ) as llm:  # chunked prefill: later chunks attend over a cached prefix
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.fixture(scope="module")
def built_in(tiny_llama_dir: Path) -> list[list[int]]:
    return greedy(tiny_llama_dir, attention_backend="torch")


def test_the_article_lines_as_written(
    example: Path,
    tiny_llama_dir: Path,
    built_in: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "custom_attention.so").symlink_to(example)
    exec(REGISTER, {})
    assert _custom_ops.registered_kernels() == {"my_attention": example}
    trace = tmp_path / "calls.txt"
    model_config = json.loads((tiny_llama_dir / "config.json").read_text())
    params = json.dumps({"trace": str(trace)})  # the article's JSON, its `{...}` filled in
    model_config.update(json.loads(block("attention_config").text.replace("{...}", params)))
    exec(CHECK, {"model_config": model_config})
    printed = capsys.readouterr().out
    assert printed.startswith("supported: LlamaForCausalLM") and "attention backend my_attention" in printed
    before = {name: counter(example, f"example_{name}_calls") for name in ("decode", "prefill", "write_kv")}
    assert greedy(tiny_llama_dir, attention=model_config["attention"]) == built_in
    after = {name: counter(example, f"example_{name}_calls") for name in ("decode", "prefill", "write_kv")}
    assert all(after[name] > before[name] for name in before), (before, after)
    assert int(trace.read_text()) == after["decode"], "the params reached the library"


def test_worker_processes_load_the_kernel_from_its_path(
    example: Path, tiny_llama_dir: Path, built_in: list[list[int]], tmp_path: Path
) -> None:
    _custom_ops.register_kernel("my_attention", example)
    trace = tmp_path / "calls.txt"
    calls_here = counter(example, "example_decode_calls")
    attention = {"type": "my_attention", "params": {"trace": str(trace)}}
    assert greedy(tiny_llama_dir, attention=attention, worker_backend="processes") == built_in
    assert int(trace.read_text()) > 0, "the worker process ran the kernel"
    assert counter(example, "example_decode_calls") == calls_here, "and this process did not"


def test_an_llm_refuses_a_kernel_it_cannot_run(example: Path, tiny_llama_dir: Path) -> None:
    _custom_ops.register_kernel("my_attention", example)
    with pytest.raises(ValueError, match="attention.type: unknown attention backend 'nope'; registered kernels: my_at"):
        LLM(str(tiny_llama_dir), attention={"type": "nope"})
    with pytest.raises(
        ValueError, match="'my_attention' reads float32 KV caches only, this worker's would be bfloat16"
    ):
        LLM(str(tiny_llama_dir), dtype="bfloat16", attention_backend="my_attention", num_kv_blocks=16)
