"""Multimodal checkpoints, a contract both sides read: which extra modules a checkpoint holds (`model_loader.
extra_modules`), the text decoder's part of its config, how many placeholder tokens an image becomes, and the
preprocessed image a plan carries to the workers (`ImageInput`: pixel values as raw little-endian float32 bytes
with their shape, never pickle). Pure Python: the scheduler reads it without torch.

Family (a) only, LLaVA (`LlavaForConditionalGeneration`: a CLIP vision tower, an MLP projector, a Llama decoder):
the projected patch embeddings replace the image's placeholder tokens in the prompt. `cross_attention` (family b,
Mllama) is a known module name that no supported checkpoint holds yet.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Meta

from proto.wire_base import Count, Record, WireError

EXTRA_MODULES = ("vision_encoder", "cross_attention")

# Per multimodal architecture: the extra modules its checkpoints hold.
MULTIMODAL_ARCHITECTURES: dict[str, tuple[str, ...]] = {"LlavaForConditionalGeneration": ("vision_encoder",)}

# One image's pixel values on the wire, at most (a 1024 x 1024 RGB image in float32 is 12 MiB).
MAX_IMAGE_BYTES = 16 * 1024 * 1024
# The new requests' pixel values one plan carries, at most (the scheduler starts the rest in later plans): half of
# proto/wire.py's MAX_MESSAGE_BYTES, the rest of the plan's room.
MAX_PLAN_IMAGE_BYTES = 32 * 1024 * 1024


class ImageInput(Record):
    """One image of a request: its content hash (keys the workers' encoder-output cache and the prefix cache), where
    its placeholder tokens start in the prompt and how many there are, and its preprocessed pixel values
    (`[channels, height, width]`, little-endian float32)."""

    hash: Annotated[bytes, Meta(min_length=8, max_length=64)]
    offset: Count
    length: Annotated[int, Meta(ge=1)]
    pixels: Annotated[bytes, Meta(max_length=MAX_IMAGE_BYTES)]
    shape: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(min_length=3, max_length=3)]
    dtype: Literal["float32"] = "float32"

    def __post_init__(self) -> None:
        if len(self.pixels) != math.prod(self.shape) * 4:
            raise WireError(f"image pixels: {len(self.pixels)} bytes for shape {self.shape} in float32")

    @property
    def end(self) -> int:
        return self.offset + self.length


def is_multimodal(config: dict[str, Any]) -> bool:
    return any(name in MULTIMODAL_ARCHITECTURES for name in config.get("architectures") or [])


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config: a multimodal checkpoint's `text_config` (named by its model_type, which
    proto/architectures.py maps to a causal LM), or the config itself."""
    if not is_multimodal(config):
        return config
    text = dict(config.get("text_config") or {})
    text.setdefault("model_type", "llama")
    text.pop("architectures", None)
    return text


def checkpoint_modules(config: dict[str, Any]) -> tuple[str, ...]:
    """The extra modules a checkpoint's config says it holds (none for a text-only model)."""
    for name in config.get("architectures") or []:
        if name in MULTIMODAL_ARCHITECTURES and config.get("vision_config"):
            return MULTIMODAL_ARCHITECTURES[name]
    return ()


def resolve_extra_modules(requested: tuple[str, ...] | list[str], folder: str | Path) -> tuple[str, ...]:
    """The modules to load: `requested` checked against the names we know and against what the checkpoint holds
    (ValueError naming the module)."""
    for name in requested:
        if name not in EXTRA_MODULES:
            raise ValueError(f"extra_modules: unknown module {name!r} (known: {', '.join(EXTRA_MODULES)})")
    held = checkpoint_modules(json.loads((Path(folder) / "config.json").read_text()))
    for name in requested:
        if name not in held:
            raise ValueError(
                f"extra_modules: {name} is not in the checkpoint {Path(folder).name} "
                f"(it holds: {', '.join(held) or 'no extra modules'})"
            )
    return tuple(dict.fromkeys(requested))


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """How a LLaVA checkpoint takes images: the placeholder token, the tokens one image becomes (its patches,
    without the class token under the `default` feature strategy), and the square side its vision tower takes."""

    image_token_id: int
    tokens_per_image: int
    image_size: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> ImageLayout:
        vision = config["vision_config"]
        side = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 14))
        full = config.get("vision_feature_select_strategy", "default") == "full"
        token = config.get("image_token_index", config.get("image_token_id", 32000))
        return cls(int(token), side * side + (1 if full else 0), int(vision.get("image_size", 224)))

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageLayout | None:
        """The layout of a multimodal checkpoint; None for a text-only one."""
        config = json.loads((Path(folder) / "config.json").read_text())
        return cls.of(config) if checkpoint_modules(config) else None
