"""MemoryMonitor: the article's keys, figures that move as a request takes KV blocks and gives them back, the same
fragmentation as the `minivllm:kv_fragmentation` metric, for an AsyncLLMEngine and an LLM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, AsyncLLMEngine, MemoryMonitor, SamplingParams
from minivllm.memory_monitor import kv_stats

pytestmark = pytest.mark.model

ARTICLE_KEYS = {"allocated", "fragmentation", "free_blocks"}


def test_stats_follow_a_request_taking_and_giving_back_blocks(tiny_llama_dir: Path) -> None:
    with AsyncLLMEngine(str(tiny_llama_dir), num_kv_blocks=32, block_size=16, dtype="float32") as engine:
        monitor = MemoryMonitor(engine)
        idle = monitor.get_stats()
        assert ARTICLE_KEYS <= set(idle)
        assert idle["allocated"] == 0 and idle["free_blocks"] == idle["total_blocks"] == 32

        async def while_running() -> dict[str, Any]:
            stream = engine.generate(list(range(100, 140)), SamplingParams(max_tokens=200, ignore_eos=True), "r")
            async for _ in stream:  # the first tokens: the 40-token prompt holds 3 blocks
                running = monitor.get_stats()
                both = engine.on_engine(lambda e: (kv_stats(e), e.live_metrics())).result(10)
                await stream.aclose()  # type: ignore[attr-defined]
                return running | {"same read": both}
            raise AssertionError("no output")

        running = asyncio.run(while_running())
        assert running["used_blocks"] >= 3 and running["free_blocks"] <= 29 and running["num_running"] == 1
        assert running["allocated"] > 0 and 0 < running["fragmentation"] < 1  # a partly filled last block
        stats, metrics = running["same read"]
        assert stats["fragmentation"] == metrics["minivllm:kv_fragmentation"]


def test_an_llm_has_the_same_stats_and_a_prefix_hit_rate(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=16, dtype="float32") as llm:
        monitor = MemoryMonitor(llm)
        prompt = list(range(200, 240))
        params = SamplingParams(max_tokens=2)
        llm.generate([prompt], params, use_tqdm=False)
        assert monitor.get_stats()["cache_hit_rate"] == 0
        llm.generate([prompt], params, use_tqdm=False)
        stats = monitor.get_stats()
    assert ARTICLE_KEYS <= set(stats) and stats["allocated"] == 0 and stats["cached_blocks"] >= 2
    assert stats["tier_hit_rates"]["device"] == stats["cache_hit_rate"] > 0  # the second prompt's blocks were found


def test_it_needs_an_engine() -> None:
    with pytest.raises(TypeError, match="engine: must be a minivllm.LLM or AsyncLLMEngine"):
        MemoryMonitor(object())  # type: ignore[arg-type]
