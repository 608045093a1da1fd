"""ModelRouter (seed 003, 5.3): models added by path, each request sent where a decorated async function says."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from minivllm import SamplingParams
from minivllm.controller import ModelRequest, ModelRouter
from router_node.routing import RouteError
from tests.seeds.blocks import block

pytestmark = pytest.mark.model

SETTINGS = {"kv_cache_memory": "16MiB", "threads": 1, "max_num_seqs": 4}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SHORT, LONG = "The sea is", "word " * 120  # 3 and more than 100 tokens


@pytest.fixture(scope="module")
def router(tiny_llama_dir: Path, tiny_qwen2_dir: Path):  # type: ignore[no-untyped-def]
    router = ModelRouter(**SETTINGS)  # the article's lines, with two tiny models for its two
    router.add_model("qwen-7b", str(tiny_qwen2_dir))
    router.add_model("llama3-70b", str(tiny_llama_dir), replicas=2)
    seen: list[ModelRequest] = []

    @router.route(strategy="latency")
    async def handle_request(request):  # type: ignore[no-untyped-def]
        seen.append(request)
        if request.len < 100:
            return "qwen-7b"
        return "llama3-70b"

    router.seen = seen  # type: ignore[attr-defined]
    with router:
        yield router


def direct(router: ModelRouter, name: str, prompt: str) -> list[int]:
    """The model's own greedy tokens for `prompt`, from its first engine."""
    return router.models[name][0].llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_the_functions_answer_picks_the_model(router: ModelRouter) -> None:
    async def both():  # type: ignore[no-untyped-def]
        return await asyncio.gather(router.generate(SHORT, PARAMS), router.generate(LONG, PARAMS))

    short, long = asyncio.run(both())
    seen = router.seen[-2:]  # type: ignore[attr-defined]
    tokenizer = router.models["qwen-7b"][0].llm.tokenizer  # the first model added's
    assert {r.prompt for r in seen} == {SHORT, LONG}
    assert all(r.len == len(tokenizer.encode(r.prompt)) for r in seen) and sorted(r.len < 100 for r in seen) == [0, 1]
    assert short.outputs[0].token_ids == direct(router, "qwen-7b", SHORT)
    assert long.outputs[0].token_ids == direct(router, "llama3-70b", LONG)
    assert direct(router, "qwen-7b", SHORT) != direct(router, "llama3-70b", SHORT)  # the two models differ
    assert sum(r.requests for r in router.replicas("llama3-70b")) == 1


def test_latency_picks_the_replica_expected_to_finish_first(router: ModelRouter) -> None:
    slow, fast = router.replicas("llama3-70b")
    before = fast.requests
    slow.observe_ttft(5.0)
    slow.observe_tpot(5.0)
    for _ in range(3):  # its own measurement stays far below the slow one's
        fast.observe_ttft(1e-3)
        fast.observe_tpot(1e-3)
    asyncio.run(router.generate(LONG, PARAMS))
    assert fast.requests == before + 1 and fast.in_flight == 0 and fast.tpot_ewma is not None


def test_an_unknown_model_from_the_function_is_a_clear_error(router: ModelRouter) -> None:
    function, strategy = router.function, router.strategy

    @router.route(strategy="round_robin")
    async def to_nowhere(request: ModelRequest) -> str:
        return "gpt-5"

    try:
        with pytest.raises(RouteError, match="to_nowhere returned 'gpt-5'") as err:
            asyncio.run(router.generate(SHORT, PARAMS))
        assert err.value.code == "NOT_FOUND" and "qwen-7b, llama3-70b" in str(err.value)
    finally:
        router.function, router.strategy = function, strategy


def test_bad_paths_names_and_strategies_are_errors_naming_them(router: ModelRouter, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^path: model 'x' cannot be served from '.*/nowhere'"):
        router.add_model("x", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="^name: 'qwen-7b' is taken"):
        router.add_model("qwen-7b", str(tmp_path))
    with pytest.raises(ValueError, match="^strategy: must be one of"):
        router.route(strategy="fastest")
    assert list(router.models) == ["qwen-7b", "llama3-70b"]


def test_the_articles_lines_as_written(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed 003's block run as written (tests/seeds/blocks.py), its two paths made links to two tiny models and its
    router's KV memory bounded for CI; the function's answer decides which model each request reaches."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "qwen").symlink_to(tiny_qwen2_dir)
    (tmp_path / "path" / "to" / "llama3").symlink_to(tiny_llama_dir)
    text = block("model_router").text
    namespace: dict[str, Any] = {}
    exec(text.replace("ModelRouter()", "ModelRouter(**SETTINGS)"), {"SETTINGS": SETTINGS} | namespace, namespace)
    router = namespace["router"]
    with router:
        short, long = asyncio.run(_both(router))
        assert short.outputs[0].token_ids == direct(router, "qwen-7b", SHORT)
        assert long.outputs[0].token_ids == direct(router, "llama3-70b", LONG)


async def _both(router: ModelRouter) -> list[Any]:
    return list(await asyncio.gather(router.generate(SHORT, PARAMS), router.generate(LONG, PARAMS)))
