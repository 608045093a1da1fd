"""AsyncEngineArgs: the article's line as written, every engine and worker setting a keyword (from the settings tree,
as LLM's), the article's names as aliases (also as flags), and bad keywords named. No model is loaded."""

from __future__ import annotations

import inspect

import pytest

import minivllm
from minivllm.engine_args import AsyncEngineArgs
from scheduler_node.cli.scheduler import build_parser, engine_config
from settings.engine_args import EngineSettings, engine_settings
from settings.setting import walk

pytestmark = pytest.mark.unit


def test_the_article_line_works_as_written() -> None:
    assert minivllm.AsyncEngineArgs is AsyncEngineArgs  # `from minivllm import AsyncEngineArgs`
    args = AsyncEngineArgs(model="Qwen-7B", scheduler_delay=0.05, max_batch_size=32, enable_preemption=True)
    assert args.model == "Qwen-7B"
    assert args.max_batch_size == args.max_num_seqs == 32
    assert args.scheduler_delay == 0.05 and args.enable_preemption is True
    assert "max_batch_size=32" in repr(args)


def test_every_engine_and_worker_setting_is_a_keyword() -> None:
    parameters = inspect.signature(AsyncEngineArgs).parameters
    for e in walk(EngineSettings):
        assert e.name in parameters and parameters[e.name].default == e.default, e.name
    assert "max_batch_size" in parameters
    assert AsyncEngineArgs(watermark=0.2, kv_cache_memory="1GiB").kv_cache_memory == 2**30


def test_enable_preemption_off_means_no_displacement_by_priority() -> None:
    on = engine_settings({"scheduling_policy": "priority", "preemption_margin": 3.0}).engine
    off = engine_settings({"scheduling_policy": "priority", "preemption_margin": 3.0, "enable_preemption": False})
    assert on.displacement_margin == 3.0
    assert off.engine.displacement_margin == 0.0  # Policy.displaces: never with a margin of 0


def test_the_article_names_are_flags_too() -> None:
    args = build_parser().parse_args(["--max-batch-size", "7", "--no-enable-preemption"])
    config = engine_config(args)
    assert config.scheduler.max_num_seqs == 7 and not config.enable_preemption


@pytest.mark.parametrize(
    ("keywords", "error", "named"),
    [
        ({"max_batch_sise": 32}, TypeError, "max_batch_sise"),
        ({"max_batch_size": 0}, ValueError, "max_batch_size must be >= 1"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be >= 1"),
        ({"max_batch_size": 8, "max_num_seqs": 8}, TypeError, "'max_batch_size' and 'max_num_seqs'"),
        ({"enable_preemption": "maybe"}, ValueError, "enable_preemption"),
        ({"worker_backend": "gpu"}, ValueError, "worker_backend"),
    ],
)
def test_bad_keywords_are_named(keywords: dict[str, object], error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        AsyncEngineArgs(model="m", **keywords)  # type: ignore[arg-type]


def test_an_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such"):
        AsyncEngineArgs().no_such  # noqa: B018
