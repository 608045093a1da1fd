"""LLM(enable_lora=True) with vLLM's LoRARequest: one generate call mixing adapters and the base model, each
prompt's greedy tokens HF + PEFT's, with one adapter slot (the others wait for it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm import LLM, LoRARequest, SamplingParams
from tests.support.lora import load_base, load_peft, make_adapter
from tests.support.models import assert_teacher_forced

pytestmark = pytest.mark.model


def test_generate_mixes_adapters_and_the_base_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    base = load_base(tiny_llama_dir)
    paths = [make_adapter(base, tmp_path / f"a{i}", seed=10 + i, rank=4 * (i + 1)) for i in range(2)]
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=1, num_kv_blocks=64) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[requests[0], requests[1], None])
        with pytest.raises(ValueError, match="is loaded from"):
            llm.generate(prompts[0], params, lora_request=LoRARequest("a0", 1, str(paths[1])))
        llm.unload_lora("a0")
        with pytest.raises(KeyError, match="not loaded"):
            llm.unload_lora("a0")
    references = [load_peft(base, paths[0]), load_peft(base, paths[1]), base]
    for out, prompt, ref in zip(outs, prompts, references):
        assert_teacher_forced(ref, prompt, out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/x")
