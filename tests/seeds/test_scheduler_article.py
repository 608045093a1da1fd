"""The scheduler article's Python blocks (tests/seeds/blocks.py), run as written: its data structures, each of
whose fields our scheduler keeps (the request's in scheduler_node/core/request.py, the block table's in
scheduler_node/core/kv/block_table.py), and its batch-size heuristic."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from proto.wire import SamplingOptions
from scheduler_node.core.kv.block_table import BlockTable
from scheduler_node.core.request import Request, StopConditions
from tests.seeds.blocks import block

pytestmark = pytest.mark.unit

# Each field of the article's classes, and where ours keeps it: (object, attribute or method) of a live one.
REQUEST_FIELDS = {
    "prompt": "prompt_token_ids",  # token ids: the doors tokenize the text
    "max_tokens": "stop.max_tokens",
    "sampling_params": "sampling",
    "arrival_time": "arrival_time",
}
TABLE_FIELDS = {"block_size": "block_size", "allocated_blocks": "blocks_of", "free_blocks": "free_blocks"}


def run(text: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"Dict": typing.Dict, "List": typing.List}  # the article's typing names  # noqa: UP006
    exec(text, namespace)
    return namespace


def resolve(obj: object, path: str) -> object:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_data_structures_are_the_schedulers() -> None:
    classes = run(block("data_structures").text)
    request = Request("r", [1, 2, 3], SamplingOptions(), StopConditions(max_tokens=8))
    table = BlockTable(num_blocks=8, block_size=16)
    table.write("r", 0, 3)
    for article, ours, fields in (
        ("SchedulingRequest", request, REQUEST_FIELDS),
        ("BlockAllocationTable", table, TABLE_FIELDS),
    ):
        assert set(typing.get_type_hints(classes[article], classes)) == set(fields), article
        for field, where in fields.items():
            assert resolve(ours, where) is not None, f"{article}.{field}: {where}"
    assert table.blocks_of("r") == [table.blocks_of("r")[0]] and len(table.free_blocks()) == 7
    assert request.stop.max_tokens == 8 and table.block_size == 16


def test_the_batch_size_heuristic_runs() -> None:
    compute_batch_size = run(block("compute_batch_size").text)["compute_batch_size"]
    assert compute_batch_size(100, 1) == 64  # the hardware cap
    assert compute_batch_size(50, 1) == 45  # 10 % of the memory kept back
