"""The vLLM article's Python lines for the asyncio engine (1.1), its memory monitor (1.3) and LMCache (5.2), run as
written (tests/seeds/blocks.py) one after another in one namespace, as a reader pastes them: the default model, the
default flags; tokens come back, the monitor prints the article's keys, the cache is the KV offload tiers."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
from typing import Any

import pytest

from minivllm import RequestOutput, SamplingParams
from tests.seeds.blocks import block

pytestmark = [pytest.mark.model, pytest.mark.slow]


async def last_output(engine: Any, prompt: str, request_id: str) -> RequestOutput:
    final = None
    async for output in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8), request_id):
        final = output
    assert final is not None and final.finished
    return final


def test_the_async_engine_monitor_and_cache_lines() -> None:
    namespace: dict[str, Any] = {}
    exec(block("async_engine").text, namespace)
    engine = namespace["engine"]
    try:
        assert engine.llm.config.scheduler.max_num_seqs == 32 and engine.llm.config.options.scheduler_delay == 0.05
        answer = asyncio.run(last_output(engine, "The capital of France is", "first"))
        assert answer.outputs[0].text.strip(), "tokens come back"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(block("memory_monitor").text, namespace)
        stats = ast.literal_eval(printed.getvalue().strip())
        assert {"allocated", "fragmentation", "free_blocks"} <= stats.keys() and stats["free_blocks"] > 0
    finally:
        engine.shutdown()
    exec(block("lm_cache").text, namespace)  # `AsyncLLMEngine(..., cache=cache)`: the defaults, and the cache
    engine = namespace["engine"]
    try:
        worker = engine.llm.options
        assert worker.kv_offload_disk_size == pytest.approx(20e9 / 2**30) and worker.kv_offload_disk
        assert engine.llm.config.scheduler.kv_offload_policy == "arc"
        assert asyncio.run(last_output(engine, "The capital of France is", "cached")).outputs[0].text.strip()
    finally:
        engine.shutdown()
