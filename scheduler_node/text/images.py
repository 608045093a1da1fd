"""Images into a request's prompt, on the scheduler side (no torch): each image preprocessed as the model's own HF
image processor does it, and each `<image>` placeholder token of the prompt expanded to the tokens the image
becomes (proto/multimodal.py `ImageLayout`), with the `ImageInput` the workers' encoder reads.

HF's `CLIPImageProcessor` imports torch (transformers does, when it is installed), so its steps are redone here
in numpy and PIL from the folder's preprocessor_config.json: RGB, resize of the shortest edge (bicubic), center
crop, rescale, normalize; tests/scheduler_node/text/test_images.py checks the result against HF's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from proto.multimodal import MAX_IMAGE_BYTES, ImageInput, ImageLayout

logger = logging.getLogger(__name__)

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """A request's image that cannot be used; `field` names where it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class ImageProcessor:
    """A CLIP-style image processor's steps and numbers (HF's preprocessor_config.json keys)."""

    shortest_edge: int
    crop: tuple[int, int]  # height, width
    resample: int = 3  # PIL's BICUBIC
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = _CLIP_MEAN
    std: tuple[float, ...] = _CLIP_STD
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, c: dict[str, Any], image_size: int) -> ImageProcessor:
        size = c.get("size") or {"shortest_edge": image_size}
        crop = c.get("crop_size") or {"height": image_size, "width": image_size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        edge = size.get("shortest_edge") if isinstance(size, dict) else size
        if not isinstance(edge, int):
            raise ValueError(f"preprocessor_config.json: size {size!r} has no shortest_edge")
        return cls(
            edge,
            (int(crop["height"]), int(crop["width"])),
            int(c.get("resample", 3)),
            float(c.get("rescale_factor", 1 / 255)),
            tuple(c.get("image_mean", _CLIP_MEAN)),
            tuple(c.get("image_std", _CLIP_STD)),
            bool(c.get("do_resize", True)),
            bool(c.get("do_center_crop", True)),
            bool(c.get("do_rescale", True)),
            bool(c.get("do_normalize", True)),
        )

    def __call__(self, image: Image.Image) -> np.ndarray:
        """`[3, height, width]` float32 pixel values."""
        image = image.convert("RGB")
        if self.do_resize:
            w, h = image.size
            short, long = min(w, h), max(w, h)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            size = (new_short, new_long) if w <= h else (new_long, new_short)  # (width, height)
            image = image.resize(size, resample=self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # HWC -> CHW
        if self.do_center_crop:
            pixels = _center_crop(pixels, *self.crop)
        out: np.ndarray = pixels.astype(np.float64)
        if self.do_rescale:  # as HF's rescale: in float64, then float32
            out = (out * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.std, dtype=np.float32)[:, None, None]
            out = (out.astype(np.float32) - mean) / std
        return np.ascontiguousarray(out, dtype=np.float32)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    _, h, w = pixels.shape
    if h < height or w < width:  # padded with zeros around, as HF's center_crop does
        padded = np.zeros((pixels.shape[0], max(h, height), max(w, width)), dtype=pixels.dtype)
        top, left = (padded.shape[1] - h) // 2, (padded.shape[2] - w) // 2
        padded[:, top : top + h, left : left + w] = pixels
        pixels, h, w = padded, padded.shape[1], padded.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top : top + height, left : left + width]


class ImagePrompts:
    """A multimodal model's images into prompts: preprocessing, limits, placeholder expansion."""

    def __init__(
        self, layout: ImageLayout, processor: ImageProcessor, limit: int, max_pixels: int, local_path: str = ""
    ) -> None:
        self.layout = layout
        self.processor = processor
        self.limit = limit  # images per prompt
        self.max_pixels = max_pixels
        self.local_path = local_path  # the folder file:// URLs may name ("": none)

    @classmethod
    def build(
        cls, folder: Path, extra_modules: tuple[str, ...], limit: int, max_pixels: int, local_path: str = ""
    ) -> ImagePrompts | None:
        """None for a text-only model, or a multimodal one served without its vision encoder (said in the log)."""
        layout = ImageLayout.from_folder(folder)
        if layout is None:
            return None
        if "vision_encoder" not in extra_modules:
            logger.info("%s takes images, but extra_modules has no vision_encoder: it serves text only", folder.name)
            return None
        path = folder / "preprocessor_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        return cls(layout, ImageProcessor.from_config(config, layout.image_size), limit, max_pixels, local_path)

    def check_count(self, count: int, field: str) -> None:
        if count > self.limit:
            raise ImageError(field, f"{count} images exceed --limit-mm-per-prompt image={self.limit}")

    def check_size(self, image: Image.Image, field: str) -> None:
        w, h = image.size
        if w * h > self.max_pixels:
            raise ImageError(field, f"{w}x{h} pixels exceed the limit of {self.max_pixels} (--max-image-pixels)")
        if w < 1 or h < 1:
            raise ImageError(field, f"an empty image ({w}x{h})")

    def expand(
        self, prompt_ids: list[int], images: list[Image.Image], fields: list[str], prompt_field: str
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image placeholder token expanded to the image's tokens, and the images (their
        `fields`: where each came from) in order; ImageError when they do not match."""
        self.check_count(len(images), fields[-1] if fields else prompt_field)
        token, n = self.layout.image_token_id, self.layout.tokens_per_image
        found = prompt_ids.count(token)
        if found != len(images):
            raise ImageError(prompt_field, f"{found} image placeholders for {len(images)} images")
        out: list[int] = []
        inputs: list[ImageInput] = []
        for t in prompt_ids:
            if t != token:
                out.append(t)
                continue
            image, field = images[len(inputs)], fields[len(inputs)]
            self.check_size(image, field)
            array = self.processor(image)
            pixels = array.tobytes()
            if len(pixels) > MAX_IMAGE_BYTES:
                raise ImageError(field, f"its pixel values take {len(pixels)} bytes, over {MAX_IMAGE_BYTES}")
            digest = hashlib.blake2b(pixels, digest_size=16).digest()
            inputs.append(ImageInput(digest, len(out), n, pixels, list(array.shape)))
            out += [token] * n
        return out, tuple(inputs)
