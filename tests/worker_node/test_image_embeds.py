"""The workers' encoder-output cache: keyed by an image's content hash, least recently used out past its byte
budget; an image's embeddings replace exactly its placeholder rows of a step, whichever chunk of it the step holds."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from proto.multimodal import ImageInput
from worker_node.image_embeds import EncoderCache, ImageEmbedder
from worker_node.models.vision import VisionEncoder

pytestmark = pytest.mark.unit


def test_the_cache_keeps_the_recently_used_within_its_budget() -> None:
    cache = EncoderCache(budget=3 * 4 * 4)  # three [4] float32 tensors
    for key in (b"a", b"b", b"c"):
        cache.put(key, torch.zeros(4))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", torch.zeros(4))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and len(cache) == 3
    cache.put(b"huge", torch.zeros(100))  # larger than the whole budget: used once, not kept
    assert cache.get(b"huge") is None and cache.used <= cache.budget


class _Encoder(VisionEncoder):
    """An 'encoder' whose patch i of an image is the image's first pixel value + i, in every column."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (pixels.flatten()[0] + torch.arange(4.0))[None, :, None].expand(1, 4, 3)


def _image(value: float, offset: int) -> ImageInput:
    pixels = np.full((3, 2, 2), value, dtype="<f4").tobytes()
    return ImageInput(bytes([int(value)]) * 16, offset, 4, pixels, [3, 2, 2])


def test_a_chunk_gets_its_rows_of_each_image_and_the_encoder_runs_once_per_image() -> None:
    encoder = _Encoder()
    embedder = ImageEmbedder(encoder)
    state = types.SimpleNamespace(images=(_image(10, 2), _image(20, 7)))  # a RequestState's images
    model = types.SimpleNamespace(embed_tokens=lambda ids: torch.full((len(ids), 3), -1.0))
    for first, count in ((0, 5), (5, 7)):  # the second image is split across the two chunks
        batch = types.SimpleNamespace(input_ids=torch.zeros(count), image_rows=[(state, 0, count, first)])
        rows = embedder.embed(model, batch)  # type: ignore[arg-type]
        column = rows[:, 0].tolist()
        want = [-1.0] * count
        for image, base in ((state.images[0], 10.0), (state.images[1], 20.0)):
            for p in range(image.offset, image.end):
                if first <= p < first + count:
                    want[p - first] = base + p - image.offset
        assert column == want, (first, column)
    assert encoder.calls == 2  # each image encoded once; the second chunk read both from the cache
