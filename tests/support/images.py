"""Images for the multimodal tests: random pictures, a tiny LLaVA's prompts with them, and HF's reference."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from proto.multimodal import ImageInput
from scheduler_node.text.images import ImagePrompts


def picture(seed: int, width: int = 40, height: int = 53) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def image_prompts(folder: Path, limit: int = 4) -> ImagePrompts:
    prompts = ImagePrompts.build(folder, ("vision_encoder",), limit, 10**8)
    assert prompts is not None
    return prompts


def with_images(
    folder: Path, text_ids: list[int], images: list[Image.Image]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """`text_ids` with one placeholder per image at its start (and between), expanded as the scheduler does."""
    prompts = image_prompts(folder)
    token = prompts.layout.image_token_id
    ids = [t for image in images for t in (token, *text_ids[:3])] + text_ids[3:]
    return prompts.expand(ids, images, [f"image[{i}]" for i in range(len(images))], "prompt")


def load_hf_llava(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def hf_pixels(folder: Path, images: list[Image.Image]) -> torch.Tensor | None:
    """HF's own image processor's pixel values (None without images)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if not images:
        return None
    return torch.from_numpy(CLIPImageProcessorPil.from_pretrained(folder)(images, return_tensors="np")["pixel_values"])


@torch.inference_mode()
def assert_teacher_forced_images(  # type: ignore[no-untyped-def]
    hf, folder: Path, prompt: list[int], images: list[Image.Image], output: list[int], tol: float = 1e-3
) -> None:
    """Every generated token is HF's argmax given the same prefix and images (within `tol` in logprob)."""
    ids = torch.tensor([prompt + output])
    logits = hf(input_ids=ids, pixel_values=hf_pixels(folder, images)).logits[0, len(prompt) - 1 : -1]
    logp = logits.float().log_softmax(-1)
    gaps = logp.max(-1).values - logp.gather(1, torch.tensor(output)[:, None])[:, 0]
    bad = (gaps > tol).nonzero().flatten().tolist()
    assert not bad, f"token {bad[0]} ({output[bad[0]]}) is {float(gaps[bad[0]]):.2e} below HF's best"
