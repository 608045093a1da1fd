"""A LLaVA model at TP 2 in worker processes: every rank encodes the images (the encoder is replicated) and the
greedy tokens are HF's, for a two-image prompt beside a text-only one."""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.tiny_models import IMAGE_TOKEN
from tests.support.images import assert_teacher_forced_images, load_hf_llava, picture

pytestmark = pytest.mark.e2e


def test_tp2_worker_processes_with_images_match_hf(tiny_llava_dir: Path) -> None:
    images = [picture(1), picture(2, 30, 70)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(
        str(tiny_llava_dir), tensor_parallel_size=2, kv_cache_memory="16MiB", threads=1, dtype="float32",
        extra_modules=["vision_encoder"], limit_mm_per_prompt="image=2",
    ) as llm:  # fmt: skip
        prompts = [{"prompt": f"{IMAGE_TOKEN} or {IMAGE_TOKEN}", "multi_modal_data": {"image": images}}, "Text"]
        outs = llm.generate(prompts, greedy, use_tqdm=False)  # type: ignore[arg-type]
    hf = load_hf_llava(tiny_llava_dir)
    for out, given in zip(outs, [images, []]):
        assert len(out.outputs[0].token_ids) == 6
        assert_teacher_forced_images(hf, tiny_llava_dir, out.prompt_token_ids, given, out.outputs[0].token_ids)
