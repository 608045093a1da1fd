"""Embeddings: a prompt's final hidden states pooled (`last` token's, or the `mean` of all), on the same engine,
scheduler and workers as generation. An embedding request is a prefill that samples one token nobody reads; the
output rank pools its prompt rows as they are computed (worker_node/model_runner.py `pool`), the scheduler adds
up the chunks (Request.add_pooled), and the request's last delta carries the vector. `mean` computes the whole
prompt (a cached prefix has no hidden states to pool); `last` takes prefix-cache hits like any prompt.

POST /v1/embeddings (OpenAI's: `input` as a string, strings, token ids or lists of them; `encoding_format` float
or base64; `dimensions`: the first d components, then normalized) and `LLM.embed` share `embedding_spec` and
`finish`.
"""

from __future__ import annotations

import array
import asyncio
import base64
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from pydantic import Field

from scheduler_node.api.openai_protocol import Int32, Prompts, _Body
from scheduler_node.api.sampling import SamplingFields
from scheduler_node.api.validation import MAX_N, InvalidField, build_spec, prompt_from_ids, prompt_from_text
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.outputs import EngineError, ErrorStatus
from scheduler_node.text.tokenizer import ModelTokenizer


class EmbeddingRequest(_Body):
    input: Prompts
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int32 | None = Field(default=None, ge=1)
    user: str | None = None
    normalize: bool = True  # vLLM's: L2-normalize (as OpenAI's embeddings are)
    priority: Int32 | None = None


def embedding_spec(
    ids: list[int], tokenizer: ModelTokenizer, max_model_len: int, request_id: str, pooling: str, priority: int
) -> RequestSpec:
    """The request that pools `ids`: one greedy token past the prompt (it is not read), the pooling set."""
    spec = build_spec(ids, SamplingFields(max_tokens=1, temperature=0.0), max_model_len, tokenizer=tokenizer,
                      request_id=request_id, priority=priority)  # fmt: skip
    return dataclasses.replace(spec, sampling=msgspec.structs.replace(spec.sampling, pooling=pooling), ignore_eos=True)


def finish(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` components (all: None), L2-normalized when asked."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if not normalize:
        return vector
    norm = math.sqrt(math.fsum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(array.array("f", vector).tobytes()).decode()


def request_specs(
    body: EmbeddingRequest, tokenizer: ModelTokenizer, max_model_len: int, request_id: str, pooling: str, priority: int
) -> list[RequestSpec]:
    """One spec per input; InvalidField naming `input[i]` or `dimensions`."""
    if len(body.input) > MAX_N:
        raise InvalidField("input", f"at most {MAX_N} inputs, got {len(body.input)}")
    specs = []
    for i, prompt in enumerate(body.input):
        name = "input" if len(body.input) == 1 else f"input[{i}]"
        if isinstance(prompt, str):
            ids = prompt_from_text(prompt, tokenizer, max_model_len, name)
        else:
            ids = prompt_from_ids(prompt, tokenizer, max_model_len, name)
        specs.append(embedding_spec(ids, tokenizer, max_model_len, f"{request_id}-{i}", pooling, priority))
    return specs


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """`dimensions` within the model's hidden size (known once a vector is back)."""
    if dimensions is not None and dimensions > hidden_size:
        raise InvalidField("dimensions", f"must be at most the model's {hidden_size}, got {dimensions}")


async def pooled(engine: EngineCore, specs: Sequence[RequestSpec]) -> list[list[float]]:
    """Each spec's pooled vector, in order; EngineFailed when the engine failed one (the others are aborted)."""
    streams = [engine.submit(spec) for spec in specs]
    try:
        return list(await asyncio.gather(*(_vector(stream) for stream in streams)))
    finally:
        for spec in specs:
            engine.abort(spec.request_id)  # nothing for a finished one


class EngineFailed(Exception):
    def __init__(self, error: EngineError) -> None:
        super().__init__(error.message)
        self.error = error


async def _vector(stream: Any) -> list[float]:
    vector: list[float] | None = None
    async for delta in stream:
        if delta.error is not None:
            raise EngineFailed(delta.error)
        if delta.finish_reason:
            vector = delta.embedding
    if vector is None:  # aborted, or workers that pool nothing
        raise EngineFailed(EngineError(ErrorStatus.INTERNAL, "the request ended without its embedding"))
    return vector


def answer(vectors: list[list[float]], body: EmbeddingRequest, model: str, prompt_tokens: int) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": encode(finish(v, body.dimensions, body.normalize),
                                                                 body.encoding_format)}
        for i, v in enumerate(vectors)
    ]  # fmt: skip
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
