"""A LLaVA model's greedy tokens are HF's argmax given the same images: one and two images per prompt, beside
text-only requests, under a chunked prefill that splits an image's tokens, after preemption; the prefix cache and
the workers' encoder cache reuse a repeated image and never another one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.engine import EngineRun, load_runner
from tests.support.images import assert_teacher_forced_images, load_hf_llava, picture, with_images
from worker_node.image_embeds import ImageEmbedder, load_image_embedder
from worker_node.model_runner import ModelRunner

pytestmark = pytest.mark.model

BLOCK = 16
TEXT = [[1, 3214, 314, 253, 1345, 30, 5248, 16926], [1, 504, 2124, 282, 1150, 30, 4590, 1205, 4187, 17]]


def llava_runner(folder: Path, num_blocks: int = 64) -> tuple[ModelRunner, ImageEmbedder]:
    runner = load_runner(folder, num_blocks, BLOCK)
    images = load_image_embedder(folder, ["vision_encoder"], torch.float32, torch.device("cpu"), first_stage=True)
    assert images is not None
    runner.forward.images = images
    return runner, images


# 8: every image's 16 tokens are split over steps; 5 blocks: the batch needs 7 at its peak (recompute preemption)
@pytest.mark.parametrize(("budget", "num_blocks"), [(2048, 64), (8, 64), (16, 5)])
def test_greedy_matches_hf_with_one_and_two_images_beside_text(
    tiny_llava_dir: Path, budget: int, num_blocks: int
) -> None:
    folder = tiny_llava_dir
    pictures = [picture(1), picture(2, 60, 31)]
    cases = [([pictures[0]], TEXT[0]), (pictures, TEXT[1]), ([], TEXT[1])]
    runner, _ = llava_runner(folder, num_blocks)
    with EngineRun(runner, tokenizer_dir=folder, max_num_batched_tokens=budget) as run:
        submitted = []
        for images, text in cases:
            prompt, inputs = with_images(folder, text, images) if images else (text, ())
            submitted.append((run.add(prompt, 12, images=inputs), prompt, images))
        run.run()
    if budget == 8:
        assert any(len(p.new_requests) + len(p.cached_requests) > 1 for p in run.plans), "no mixed batch"
    if num_blocks == 5:
        assert run.scheduler.num_preemptions > 0, "the test lost its point: no preemption happened"
    hf = load_hf_llava(folder)
    for entry, prompt, images in submitted:
        assert len(entry.output) == 12
        assert_teacher_forced_images(hf, folder, prompt, images, entry.output)


def test_a_repeated_image_hits_the_caches_and_another_image_misses(tiny_llava_dir: Path) -> None:
    folder = tiny_llava_dir
    runner, images = llava_runner(folder)
    text = TEXT[1] * 2  # with the image: 16 + 20 tokens, a full first block that covers image tokens
    same, other = picture(5), picture(6)
    with EngineRun(runner, tokenizer_dir=folder, enable_prefix_caching=True) as run:
        first_prompt, first = with_images(folder, text, [same])
        a = run.add(first_prompt, 6, images=first)
        run.run()
        hits, encoded = run.scheduler.counters.prefix_cache_hits, images.cache.misses
        b = run.add(first_prompt, 6, images=with_images(folder, text, [same])[1])
        run.run()
        assert run.scheduler.counters.prefix_cache_hits > hits, "the same image and text found no cached block"
        assert images.cache.misses == encoded, "a repeated image was encoded again"
        hits = run.scheduler.counters.prefix_cache_hits
        other_prompt, others = with_images(folder, text, [other])
        assert other_prompt == first_prompt  # the same tokens: only the image's hash tells the blocks apart
        c = run.add(other_prompt, 6, images=others)
        run.run()
        assert run.scheduler.counters.prefix_cache_hits == hits, "another image hit the first image's blocks"
        assert images.cache.misses == encoded + 1
    assert a.output == b.output
    hf = load_hf_llava(folder)
    assert_teacher_forced_images(hf, folder, first_prompt, [same], a.output)
    assert_teacher_forced_images(hf, folder, other_prompt, [other], c.output)
