"""What one request may ask of a door (issue 25, defects 2, 5, 6), without a model: prompt logprobs bounded in total,
lone surrogates found with their path, deep schemas and out-of-range x-priority headers refused naming the field,
a prompt of millions of ids refused by its length, large answers encoded off the event loop exactly as
JSONResponse would, and the heap trimmed once after a burst of large refusals."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.responses import JSONResponse

from scheduler_node.api import heap
from scheduler_node.api.openai_encode import encode, json_response, sse_event
from scheduler_node.api.request_bounds import MAX_PROMPT_LOGPROB_ENTRIES, check_prompt_logprobs, lone_surrogate_at
from scheduler_node.api.sampling import SamplingFields, StructuredFields
from scheduler_node.api.validation import (
    MAX_JSON_DEPTH,
    InvalidField,
    build_spec,
    priority_from,
    prompt_from_ids,
)
from scheduler_node.core.request import RequestSpec

pytestmark = pytest.mark.unit

# What the checks below ask of a tokenizer; none of them tokenizes.
TOKENIZER: Any = SimpleNamespace(vocab_size=49152, max_token_chars=16)


def spec(prompt_tokens: int, n: int, prompt_logprobs: int | None = 20, **fields: Any) -> RequestSpec:
    s = SamplingFields(n=n, max_tokens=1, prompt_logprobs=prompt_logprobs, **fields)
    return build_spec(list(range(3, 3 + prompt_tokens)), s, prompt_tokens + 1, tokenizer=TOKENIZER)


def test_prompt_logprobs_are_bounded_in_total() -> None:
    check_prompt_logprobs([spec(1000, 12)])  # 1000 x 21 x 12 = 252,000: at most the bound
    check_prompt_logprobs([spec(4000, 64, prompt_logprobs=None)])  # none asked
    with pytest.raises(InvalidField) as err:
        check_prompt_logprobs([spec(4000, 64)], "sampling.prompt_logprobs")  # the 347 MB answer
    assert err.value.field == "sampling.prompt_logprobs"
    assert f"= 5376000 entries exceeds {MAX_PROMPT_LOGPROB_ENTRIES}" in str(err.value)
    with pytest.raises(InvalidField):  # several prompts count together
        check_prompt_logprobs([spec(700, 6), spec(700, 6), spec(700, 6)])


def test_lone_surrogates_are_found_with_their_path() -> None:
    assert lone_surrogate_at({"prompt": "fine é 字 🙂", "stop": ["a"], "n": 2, "x": None}) is None
    assert lone_surrogate_at({"prompt": "a\ud800b"}) == "prompt"
    assert lone_surrogate_at({"prompt": ["ok", "\udfff"]}) == "prompt[1]"
    assert lone_surrogate_at({"messages": [{"role": "user", "content": "x"}, {"content": "\ud83d"}]}) == (
        "messages[1].content"
    )
    assert lone_surrogate_at({"logit_bias": {"\ud800": 1}}) == "logit_bias"  # a key: named by its object
    assert lone_surrogate_at({"\ud800": 1}) == "body"


def test_schema_text_nested_past_the_bound_is_refused_not_a_recursion_error() -> None:
    def refused(schema: str | dict[str, Any]) -> InvalidField:
        with pytest.raises(InvalidField) as err:
            spec(4, 1, None, structured=StructuredFields(json=schema))
        return err.value

    for depth in (500, 2000):  # Python's parser raised RecursionError (a 500, gRPC UNKNOWN)
        text = '{"a":' * depth + "[]" + "}" * depth
        err = refused(text)
        assert err.field == "structured.json" and "nested deeper than" in str(err)
    parsed: dict[str, Any] = {}
    for _ in range(MAX_JSON_DEPTH):  # as a door that parsed the body hands it over
        parsed = {"items": [parsed]}
    assert "nested deeper than" in str(refused(parsed))
    assert "not JSON" in str(refused("{"))


def test_x_priority_header_has_the_body_priority_range() -> None:
    assert priority_from(None, "2147483647") == 2**31 - 1
    assert priority_from(None, "-2147483648") == -(2**31)
    assert priority_from(7, str(10**30)) == 7  # the body's own wins, the header unread
    for header in (str(10**30), str(2**31), "1e3", "9" * 5000):
        with pytest.raises(InvalidField) as err:
            priority_from(None, header)
        assert err.value.field == "priority" and len(str(err.value)) < 200, header


def test_millions_of_prompt_ids_are_refused_by_their_length() -> None:
    ids = [10**9] * 2_000_000  # out of the vocabulary too: the length is what is reported, before any walk
    with pytest.raises(InvalidField) as err:
        prompt_from_ids(ids, TOKENIZER, 1024, "prompt_token_ids")
    assert "prompt has 2000000 tokens; max_model_len is 1024" in str(err.value)


def answer(prompt_tokens: int, n: int) -> dict[str, Any]:
    """A completion's answer in its shape: the prompt's logprobs (one list) repeated in each of n choices."""
    entry = {str(t): {"logprob": -1.5 - t / 7, "rank": t, "decoded_token": "é字"} for t in range(21)}
    shared: list[Any] = [None, *[dict(entry) for _ in range(prompt_tokens - 1)]]
    choices = [{"index": i, "text": "ok\n", "logprobs": None, "finish_reason": "length", "prompt_logprobs": shared}
               for i in range(n)]  # fmt: skip
    return {"id": "cmpl-1", "object": "text_completion", "choices": choices, "usage": {"prompt_tokens": 3}}


def test_encode_renders_what_json_response_renders() -> None:
    for body in (answer(1, 1), answer(300, 3), answer(700, 2), {"a": [[1, 2]] * 600, "b": {"c": []}}, {}):
        assert encode(body) == JSONResponse(body).body
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        assert sse_event(body) == f"data: {text}\n\n"


def test_a_large_answer_is_encoded_off_the_event_loop() -> None:
    body = answer(600, 12)  # 151,200 entries (the bound: 262,144), ~10 MB of JSON
    start = time.perf_counter()
    expected = JSONResponse(body).body  # what a door did on the event loop
    on_loop = time.perf_counter() - start

    async def main() -> float:
        lag = 0.0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal lag
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                lag, last = max(lag, now - last), now

        tick = asyncio.ensure_future(ticker())
        response = await json_response(body, large=True)
        done.set()
        await tick
        assert response.body == expected
        return lag

    lag = asyncio.run(main())
    assert lag < on_loop / 4, f"the loop stalled {lag:.3f} s; encoding on it takes {on_loop:.3f} s"


def test_a_burst_of_refusals_costs_one_trim() -> None:
    if not heap.malloc_trim():
        pytest.skip("the C library has no malloc_trim (not glibc)")

    async def main() -> None:
        trimmer = heap.HeapTrimmer(min_interval_s=0.2)
        for _ in range(10):
            trimmer.soon()
        await until(lambda: trimmer.trims == 1)
        trimmer.soon()  # within the interval: it waits for it, then trims once more
        await until(lambda: trimmer.trims == 2)
        assert not trimmer._pending

    asyncio.run(main())


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not true in time"
        await asyncio.sleep(0.01)
