"""The vLLM article's GGUF line (section 4.3), `vllm-convert --input qwen.gguf --output qwen-vllm --quantization
awq`, run as written in a folder where qwen.gguf is a tiny random Llama with the default model's tokenizer
(tests/support/tiny_gguf.py: the default model's 30 layers take minutes of AWQ search); the folder it writes is
an AWQ checkpoint the engine serves."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from tests.seeds.blocks import block
from tests.support.tiny_gguf import build_tiny_gguf
from worker_node.convert import main as convert_main

pytestmark = pytest.mark.model


def test_convert_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(block("convert_gguf").text)
    assert argv[0] == "vllm-convert"
    build_tiny_gguf(tmp_path / argv[argv.index("--input") + 1])
    assert convert_main(argv[1:]) == 0
    output = tmp_path / argv[argv.index("--output") + 1]
    assert json.loads((output / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    with LLM(str(output), kv_cache_memory="16MiB", threads=1) as llm:
        answer = llm.generate("The capital of France is", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(answer[0].outputs[0].token_ids) == 3
