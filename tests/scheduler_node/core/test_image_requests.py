"""Requests with images on the scheduler: a block covering an image's placeholders is keyed by the image too, and a
plan carries at most MAX_PLAN_IMAGE_BYTES of new requests' pixels (the others start in the next plans)."""

from __future__ import annotations

import pytest

from proto.multimodal import MAX_PLAN_IMAGE_BYTES, ImageInput
from proto.wire import SamplingOptions
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.request import Request, StopConditions
from scheduler_node.core.scheduler import Scheduler

pytestmark = pytest.mark.unit

SIDE = 1024  # 3 x 1024 x 1024 float32: 12 MiB of pixels


def image(tag: int, offset: int = 2, side: int = 2) -> ImageInput:
    return ImageInput(bytes([tag]) * 16, offset, 4, bytes(3 * side * side * 4), [3, side, side])


def request(rid: str, *images: ImageInput) -> Request:
    return Request(rid, list(range(10, 30)), SamplingOptions(0.0), StopConditions(2), images=images)


def test_blocks_over_an_images_placeholders_are_keyed_by_the_image() -> None:
    a, b, text = request("a", image(1)), request("b", image(2)), request("t")
    hashes = [r.update_block_hashes(8) for r in (a, b, text)]
    assert hashes[0][0] != hashes[1][0] != hashes[2][0]  # block 0 covers positions 2..5: the images differ
    assert hashes[0][1] != hashes[1][1]  # chained: every later block differs too
    assert request("a2", image(1)).update_block_hashes(8) == hashes[0]  # the same image: the same blocks
    late = request("late", image(1, offset=12))
    assert late.update_block_hashes(8)[0] == hashes[2][0]  # block 0 holds no placeholder of it


def test_a_plan_carries_a_bounded_amount_of_pixels() -> None:
    config = SchedulerConfig(block_size=8, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512)
    s = Scheduler(config, 64)
    per_plan = MAX_PLAN_IMAGE_BYTES // len(image(0, side=SIDE).pixels)
    assert per_plan >= 1
    for i in range(per_plan + 2):
        s.add(request(f"r{i}", image(i, side=SIDE)))
    s.add(request("text"))
    plan = s.schedule()
    assert len(plan.new_requests) == per_plan + 1  # the text-only request passes the ones that wait
    assert sum(len(i.pixels) for r in plan.new_requests for i in r.images) <= MAX_PLAN_IMAGE_BYTES
