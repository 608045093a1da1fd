"""LLM with a LLaVA model as vLLM users call it: `generate` with `{"prompt": ..., "multi_modal_data": {"image":
...}}` and `chat` with image parts give HF's greedy tokens; limits, mismatches and a checkpoint served without its
vision encoder are refused by field, and `extra_modules` naming what the checkpoint lacks stops the LLM at start."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.prompts import TextPrompt
from minivllm.tiny_models import IMAGE_TOKEN
from tests.support.images import assert_teacher_forced_images, load_hf_llava, picture, png_bytes

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_generate_and_chat_with_images_match_hf(tiny_llava_dir: Path) -> None:
    one, two = picture(1), picture(2, 64, 30)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(two)).decode()
    chat = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": one},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]}]  # fmt: skip
    with LLM(
        str(tiny_llava_dir), dtype="float32", num_kv_blocks=64, extra_modules=["vision_encoder"],
        limit_mm_per_prompt={"image": 2}, max_num_batched_tokens=24,
    ) as llm:  # fmt: skip
        prompts: list[TextPrompt | str] = [
            {"prompt": f"USER: {IMAGE_TOKEN}\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": one}},
            "A text-only prompt beside them",
            {"prompt": f"{IMAGE_TOKEN} or {IMAGE_TOKEN}?", "multi_modal_data": {"image": [one, two]}},
        ]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        (answer,) = llm.chat(chat, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"prompts\[0\].prompt: 0 image placeholders for 1 images"):
            llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": one}}, GREEDY)
        with pytest.raises(ValueError, match=r"prompts\[0\]: 1 image placeholders for 0 images"):
            llm.generate(f"{IMAGE_TOKEN} without its image", GREEDY)
        with pytest.raises(ValueError, match=r"image\[2\]: 3 images exceed --limit-mm-per-prompt image=2"):
            llm.generate({"prompt": IMAGE_TOKEN * 3, "multi_modal_data": {"image": [one] * 3}}, GREEDY)
        with pytest.raises(ValueError, match=r"multi_modal_data.video: only 'image'"):
            llm.generate({"prompt": IMAGE_TOKEN, "multi_modal_data": {"video": one}}, GREEDY)
        with pytest.raises(ValueError, match=r"multi_modal_data.image: must be a PIL.Image.Image"):
            llm.generate({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": b"png"}}, GREEDY)
        assert llm.engine.scheduler.blocks.num_free == 64
    hf = load_hf_llava(tiny_llava_dir)
    for out, images in zip([*outs, answer], [[one], [], [one, two], [one, two]]):
        assert len(out.outputs[0].token_ids) == 6
        assert_teacher_forced_images(hf, tiny_llava_dir, out.prompt_token_ids, images, out.outputs[0].token_ids)


def test_without_the_vision_encoder_the_model_serves_text_only(tiny_llava_dir: Path) -> None:
    with pytest.raises(ValueError, match="extra_modules: cross_attention is not in the checkpoint"):
        LLM(str(tiny_llava_dir), extra_modules=["cross_attention"])
    with LLM(str(tiny_llava_dir), dtype="float32", num_kv_blocks=16) as llm:
        (text,) = llm.generate("Just text", GREEDY, use_tqdm=False)
        assert len(text.outputs[0].token_ids) == 6
        with pytest.raises(ValueError, match=r"prompts\[0\].multi_modal_data.image: this model takes no images"):
            llm.generate({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": picture(1)}}, GREEDY)
