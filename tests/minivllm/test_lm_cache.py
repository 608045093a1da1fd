"""LMCache: the article's line as written, its capacity, policy and target spelled into the KV offload tier
settings, bad values named, and a long prompt that returns after its blocks left the device is a tier hit (RAM
through `LLM(cache=)`, disk through `AsyncLLMEngine(cache=)`), visible as MemoryMonitor's hit rate."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, AsyncLLMEngine, LMCache, MemoryMonitor, SamplingParams
from minivllm.lm_cache import with_cache

BLOCK = 16
PREFIX = 48  # three full blocks
ENGINE: dict[str, Any] = {"num_kv_blocks": 12, "block_size": BLOCK, "max_num_batched_tokens": 64, "dtype": "float32"}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def prompts(seed: int) -> list[list[int]]:
    """A long prompt, three unrelated prompts that take the whole device pool, then the long prompt's prefix again
    (tests/worker_node/kv/test_tiers.py's pattern)."""
    rng = random.Random(seed)
    prefix = tokens(rng, PREFIX)
    return [prefix + tokens(rng, 5), *(tokens(rng, 64) for _ in range(3)), prefix + tokens(rng, 7)]


@pytest.mark.unit
def test_the_article_line_is_the_disk_tier_settings() -> None:
    cache = LMCache(capacity="20GB", policy="arc", offload_to="disk")
    settings = cache.settings()
    assert settings["kv_offload_disk_size"] == pytest.approx(20e9 / 2**30)
    assert settings["kv_offload_policy"] == "arc" and Path(settings["kv_offload_disk"]).is_dir()
    ram = LMCache(capacity="512MiB", policy="lru", offload_to="ram").settings()
    assert ram == {"kv_offload_ram": 0.5, "kv_offload_policy": "lru"}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"capacity": "20 gallons"}, "capacity"),
        ({"capacity": "0GB"}, "capacity"),
        ({"capacity": 2.5}, "capacity"),
        ({"policy": "fifo"}, "policy: must be one of arc, lru"),
        ({"offload_to": "tape"}, "offload_to: must be one of ram, disk"),
        ({"offload_to": "ram", "path": "/tmp"}, "path"),
    ],
)
def test_bad_values_are_named(keywords: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        LMCache(**keywords)  # type: ignore[arg-type]


@pytest.mark.unit
def test_a_folder_it_cannot_write_in_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="^path:"):
        LMCache(offload_to="disk", path=str(tmp_path / "file"))


@pytest.mark.unit
def test_a_setting_given_twice_is_named() -> None:
    with pytest.raises(ValueError, match="kv_offload_policy: given both"):
        with_cache(LMCache(offload_to="ram"), {"kv_offload_policy": "lru"})
    with pytest.raises(TypeError, match="cache: must be a minivllm.LMCache"):
        with_cache("20GB", {})  # type: ignore[arg-type]


@pytest.mark.model
def test_llm_cache_in_ram_serves_a_returning_prefix(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_llama_dir), cache=LMCache(capacity="1MiB", policy="lru", offload_to="ram"), **ENGINE) as llm:
        assert llm.config.scheduler.kv_offload_policy == "lru" and llm.options.kv_offload_ram == 1 / 1024
        for prompt in prompts(7):
            llm.generate([prompt], params, use_tqdm=False)
        tiers = llm.engine.scheduler.tiers
        assert tiers is not None and tiers.snapshot().hits_ram == 3, "the three prefix blocks came back from RAM"
        stats = MemoryMonitor(llm).get_stats()
    assert stats["tier_hit_rates"]["ram"] > 0 and stats["cache_hit_rate"] >= stats["tier_hit_rates"]["ram"]


@pytest.mark.model
def test_async_engine_cache_on_disk_serves_a_returning_prefix(tiny_llama_dir: Path, tmp_path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cache = LMCache(capacity="4MB", policy="arc", offload_to="disk", path=str(tmp_path))

    async def run(engine: AsyncLLMEngine) -> None:
        for i, prompt in enumerate(prompts(11)):
            async for _ in engine.generate(prompt, params, f"p{i}"):
                pass

    with AsyncLLMEngine(str(tiny_llama_dir), cache=cache, **ENGINE) as engine:
        asyncio.run(run(engine))
        tiers = engine.engine.scheduler.tiers
        assert tiers is not None and tiers.snapshot().hits_disk == 3, "the three prefix blocks came back from disk"
        assert MemoryMonitor(engine).get_stats()["tier_hit_rates"]["disk"] > 0
    assert (tmp_path / "rank0.kvtier").exists()
