"""The scheduler's image preprocessing (numpy and PIL, no torch) gives HF's own image processor's pixel values, and
a prompt's placeholders expand to the image's tokens, each image with its content hash and place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proto.multimodal import ImageInput
from scheduler_node.text.images import ImageError, ImagePrompts
from tests.support.images import hf_pixels, image_prompts, picture

pytestmark = pytest.mark.model


@pytest.mark.parametrize("size", [(40, 53), (90, 31), (28, 28), (12, 9)])  # tall, wide, exact, smaller than the crop
def test_pixels_are_hf_image_processors(tiny_llava_dir: Path, size: tuple[int, int]) -> None:
    image = picture(3, *size)
    ours = image_prompts(tiny_llava_dir).processor(image)
    theirs = hf_pixels(tiny_llava_dir, [image])
    assert theirs is not None
    assert ours.shape == tuple(theirs.shape[1:]) and ours.dtype == np.float32
    assert float(np.abs(ours - theirs[0].numpy()).max()) < 1e-6


def test_placeholders_expand_to_each_images_tokens(tiny_llava_dir: Path) -> None:
    prompts = image_prompts(tiny_llava_dir, limit=2)
    token, n = prompts.layout.image_token_id, prompts.layout.tokens_per_image
    assert n == 16
    ids, images = prompts.expand([1, token, 5, token, 6], [picture(1), picture(2)], ["a", "b"], "prompt")
    assert ids == [1, *[token] * n, 5, *[token] * n, 6]
    assert [(i.offset, i.length) for i in images] == [(1, n), (2 + n, n)]
    assert images[0].hash != images[1].hash and all(isinstance(i, ImageInput) for i in images)
    again = prompts.expand([token], [picture(1)], ["a"], "prompt")[1][0]
    assert again.hash == images[0].hash  # the same picture: the same content hash


def test_mismatches_and_limits_name_the_field(tiny_llava_dir: Path) -> None:
    prompts = image_prompts(tiny_llava_dir, limit=1)
    token = prompts.layout.image_token_id
    with pytest.raises(ImageError, match="prompt: 0 image placeholders for 1 images"):
        prompts.expand([1, 2], [picture(1)], ["image"], "prompt")
    with pytest.raises(ImageError, match=r"image\[1\]: 2 images exceed --limit-mm-per-prompt image=1"):
        prompts.expand([token, token], [picture(1), picture(2)], ["image[0]", "image[1]"], "prompt")
    small = ImagePrompts(prompts.layout, prompts.processor, 1, max_pixels=100)
    with pytest.raises(ImageError, match="image: 40x53 pixels exceed the limit of 100"):
        small.expand([token], [picture(1)], ["image"], "prompt")


def test_a_text_only_model_or_one_without_its_encoder_takes_no_images(
    tiny_llava_dir: Path, tiny_llama_dir: Path
) -> None:
    assert ImagePrompts.build(tiny_llama_dir, ("vision_encoder",), 1, 100) is None
    assert ImagePrompts.build(tiny_llava_dir, (), 1, 100) is None
