"""Images into a step's embeddings (LLaVA, `model_loader.extra_modules: [vision_encoder]`): the rows of an image's
placeholder tokens take its projected patch embeddings instead of the placeholder token's embedding.

An image is encoded whole in the first step that computes any of its placeholder positions (a chunked prefill
that splits it reads the rest from the cache in its next steps), and kept in an encoder-output cache keyed by its
content hash under a byte budget, least recently used out first: a repeated image, in this request or another, is
not encoded again. Every TP rank runs the same encoder on the same pixels (the encoder is replicated); with
pipeline parallelism only the first stage embeds.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from proto.multimodal import ImageInput, checkpoint_modules, resolve_extra_modules
from worker_node.models.decoder import CausalLM
from worker_node.models.vision import VisionEncoder, load_vision_encoder
from worker_node.step_inputs import StepInputs

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


class EncoderCache:
    """Encoder outputs by image content hash, least recently used out first once past `budget` bytes (an entry
    larger than the whole budget is used for its step and not kept)."""

    def __init__(self, budget: int = DEFAULT_CACHE_BYTES) -> None:
        self.budget = budget
        self.used = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return found

    def put(self, key: bytes, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        self.misses += 1
        if size > self.budget:
            return
        while self.used + size > self.budget:
            _, old = self._entries.popitem(last=False)
            self.used -= old.numel() * old.element_size()
        self._entries[key] = value
        self.used += size


class ImageEmbedder:
    def __init__(self, encoder: VisionEncoder, cache: EncoderCache | None = None) -> None:
        self.encoder = encoder
        self.cache = cache if cache is not None else EncoderCache()
        self.device = next(encoder.parameters()).device

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """`[image.length, hidden]`: the image's projected patches (from the cache when it was seen)."""
        found = self.cache.get(image.hash)
        if found is not None:
            return found
        pixels = np.frombuffer(image.pixels, dtype="<f4").reshape(image.shape)
        out = self.encoder(torch.from_numpy(pixels.copy()).to(self.device)[None])[0]
        if out.shape[0] != image.length:
            raise ValueError(f"an image of {image.length} placeholder tokens encodes to {out.shape[0]} embeddings")
        self.cache.put(image.hash, out)
        return out

    def embed(self, model: CausalLM, batch: StepInputs) -> torch.Tensor:
        """The step's input embeddings: its tokens' (the model's embedding, a TP collective on every rank), with
        each image's rows replaced by its patches."""
        if model.embed_tokens is None:
            raise RuntimeError("only the first pipeline stage embeds images")
        hidden = model.embed_tokens(batch.input_ids)
        for state, first_row, count, first in batch.image_rows:
            last = first + count
            for image in state.images:
                lo, hi = max(first, image.offset), min(last, image.end)
                if lo < hi:
                    patches = self.embeddings(image)
                    rows = slice(first_row + lo - first, first_row + hi - first)
                    hidden[rows] = patches[lo - image.offset : hi - image.offset].to(hidden.dtype)
        return hidden


def load_image_embedder(
    folder: str | Path,
    extra_modules: list[str],
    dtype: torch.dtype,
    device: torch.device,
    first_stage: bool,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
) -> ImageEmbedder | None:
    """The vision encoder of a multimodal checkpoint when `extra_modules` names it (checked against the checkpoint:
    ValueError naming a module it lacks), on the first pipeline stage (the one that embeds), with an encoder-output
    cache of `cache_bytes` (--encoder-cache-memory); None otherwise."""
    modules = resolve_extra_modules(extra_modules, folder)
    config = json.loads((Path(folder) / "config.json").read_text())
    if "vision_encoder" not in modules:
        if "vision_encoder" in checkpoint_modules(config):
            logger.info(
                "%s holds a vision encoder, not loaded (no vision_encoder in extra_modules): text only",
                Path(folder).name,
            )
        return None
    if not first_stage:
        return None
    return ImageEmbedder(load_vision_encoder(folder, config, dtype, device), EncoderCache(cache_bytes))
