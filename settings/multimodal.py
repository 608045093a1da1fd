"""Multimodal models' settings (proto/multimodal.py, scheduler_node/text/images.py): which extra modules of the
checkpoint load, how many images a prompt may hold, the largest image, and where local image files may be read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proto.multimodal import EXTRA_MODULES
from settings.setting import check, setting

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    """Images into a multimodal model: its modules, and the bounds of what a request may send."""

    # The article's `model_loader: {extra_modules: [...]}` (settings/config_file.py reads that section too).
    extra_modules: tuple[str, ...] = setting(
        (),
        repeat="+",
        choices=EXTRA_MODULES,
        readers=("scheduler", "worker"),
        help="a multimodal checkpoint's extra modules to load (vision_encoder: a LLaVA model takes images; "
        "cross_attention: none yet); each must be in the checkpoint; without vision_encoder it serves text only",
    )
    limit_mm_per_prompt: str = setting(
        "image=1",
        readers="scheduler",
        help='images a prompt may hold, as vLLM spells it: image=N (or JSON {"image": N}); more is refused',
    )
    max_image_pixels: int = setting(
        DEFAULT_MAX_IMAGE_PIXELS,
        low=1,
        readers="scheduler",
        help="the most pixels (width x height) an image may have; a larger one is refused before it is decoded",
    )
    allowed_local_media_path: str = setting(
        "",
        readers="scheduler",
        help='a folder whose files requests may name as file:// image URLs ("": none; http(s) URLs are never fetched)',
    )

    def __post_init__(self) -> None:
        check(self)
        image_limit(self.limit_mm_per_prompt)

    @property
    def images_per_prompt(self) -> int:
        return image_limit(self.limit_mm_per_prompt)


def image_limit(text: str) -> int:
    """Images per prompt from `--limit-mm-per-prompt` (vLLM's spelling: `image=2`, or JSON `{"image": 2}`)."""
    text = text.strip()
    pairs: dict[str, Any] = {}
    if text.startswith("{"):
        try:
            pairs = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt: not JSON ({exc})") from None
    elif text:
        for item in text.split(","):
            key, _, value = item.partition("=")
            pairs[key.strip()] = value.strip()
    unknown = [k for k in pairs if k != "image"]
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: modality {unknown[0]!r} is not served (image only)")
    try:
        limit = int(pairs.get("image", 1))
    except (TypeError, ValueError):
        raise ValueError(f"limit_mm_per_prompt: image={pairs['image']!r} is not a whole number") from None
    if limit < 0:
        raise ValueError(f"limit_mm_per_prompt: image={limit} must be 0 or more")
    return limit
