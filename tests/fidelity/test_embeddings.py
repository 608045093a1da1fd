"""Embeddings are HF's pooled final hidden states (cosine >= 0.9999 in float32): POST /v1/embeddings with the
official client, last-token and mean pooling, alone and batched, through chunked prefill (the mean adds chunks
up) and prefix-cache hits (last pooling takes them, mean computes the whole prompt); base64 and `dimensions`."""

from __future__ import annotations

import base64
import math
import random
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.engine import EngineRun, load_runner
from tests.support.models import load_hf
from tests.support.openai_door import MODEL, openai_client

pytestmark = pytest.mark.model

LENGTHS = [1, 7, 16, 17, 40]  # inside, at and across blocks; 40 spans three chunks of 16


@torch.inference_mode()
def hf_pooled(folder: Path, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    hf = load_hf(folder)
    out = []
    for prompt in prompts:
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0].float()
        vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
        out.append(torch.nn.functional.normalize(vector, dim=0).numpy())
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_embeddings_are_hfs_pooled_hidden_states(kind: str, pooling: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(f"tiny_{kind}_dir")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in LENGTHS]
    expected = hf_pooled(folder, prompts, pooling)
    with EngineRun(load_runner(folder, 64, 16), tokenizer_dir=folder, max_num_batched_tokens=16) as run:

        async def scenario() -> None:
            async with openai_client(run.engine, ModelTokenizer(folder), embedding_pooling=pooling) as (client, _):
                await check(client, prompts, expected)

        run.serve(scenario)


async def check(client: openai.AsyncOpenAI, prompts: list[list[int]], expected: list[np.ndarray]) -> None:
    batched = await client.embeddings.create(model=MODEL, input=prompts)
    assert [d.index for d in batched.data] == list(range(len(prompts)))
    assert batched.usage.prompt_tokens == sum(map(len, prompts))
    for data, want in zip(batched.data, expected):
        assert cosine(np.array(data.embedding), want) >= 0.9999
        assert math.isclose(float(np.linalg.norm(data.embedding)), 1.0, rel_tol=1e-5)
    alone = await client.embeddings.create(model=MODEL, input=prompts[-1], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(alone.data[0].embedding), dtype="<f4")  # type: ignore[arg-type]
    assert cosine(vector, expected[-1]) >= 0.9999  # again: the prefix cache holds it now
    short = await client.embeddings.create(model=MODEL, input=prompts[-1], dimensions=8)
    cut = np.array(short.data[0].embedding)
    assert len(cut) == 8 and cosine(cut, expected[-1][:8]) >= 0.9999
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        await client.embeddings.create(model=MODEL, input="hi", dimensions=100_000)
