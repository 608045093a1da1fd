"""POST /v1/embeddings' checks and shapes, without a model: bad inputs are 400s naming the field; vectors are cut
to `dimensions` and normalized; base64 is little-endian float32; a request that ends without its vector is a 500
naming why, and the server stays up. (HF equality: tests/fidelity/test_embeddings.py.)"""

from __future__ import annotations

import array
import asyncio
import base64
import math
from typing import Any

import pytest

from scheduler_node.api.embeddings import encode, finish
from tests.support.openai_door import MODEL, openai_client
from tests.support.stand_in import running, stand_in_engine, tokenizer

pytestmark = pytest.mark.unit


def test_vectors_are_cut_normalized_and_encoded() -> None:
    assert finish([3.0, 4.0, 12.0], 2, True) == [0.6, 0.8]
    assert finish([3.0, 4.0], None, False) == [3.0, 4.0]
    assert math.isclose(sum(v * v for v in finish([1.0, 2.0, 3.0], None, True)), 1.0)
    data = base64.b64decode(encode([0.5, -2.0], "base64"))  # type: ignore[arg-type]
    assert array.array("f", data).tolist() == [0.5, -2.0] and encode([1.0], "float") == [1.0]


def test_bad_inputs_are_400s_naming_the_field() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": []}, "input"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1, 2], [10**9]]}, "input[1]"),
        ({"input": "hi", "model": "other"}, "model"),
    ]

    async def main() -> None:
        engine = stand_in_engine()  # its workers pool nothing: a request ends without its vector
        async with running(engine), openai_client(engine, tokenizer()) as (_, raw):
            for change, param in cases:
                bad = await raw.post("/embeddings", json={"model": MODEL, **change})
                assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, (change, bad.json())
            failed = await raw.post("/embeddings", json={"input": "hi"})
            assert failed.status_code == 500 and "without its embedding" in failed.json()["error"]["message"]
            assert (await raw.post("/embeddings", json={"input": []})).status_code == 400  # still up
            assert engine.num_live == 0

    asyncio.run(main())
