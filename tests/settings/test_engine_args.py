"""`LLM(...)`'s keywords and vllm-scheduler's engine flags come from one tree through one function
(settings/engine_args.py), so they cannot drift: every engine and worker setting is an LLM keyword that reaches its
place in the built config, every engine setting the scheduler's command line has builds the same config there, and
an unknown keyword is a TypeError naming it. No model is loaded: the builder is tried on its own."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from minivllm.llm import LLM
from scheduler_node.cli.scheduler import build_parser as scheduler_parser
from scheduler_node.cli.scheduler import engine_config
from settings.build import flat_values
from settings.cli import Part, to_argv
from settings.engine import EngineConfig
from settings.engine_args import EngineSettings, engine_settings
from settings.setting import Entry, walk
from settings.worker import WorkerOptions

pytestmark = pytest.mark.unit

# A value other than the default for the settings whose kind says too little (text), and what each needs beside.
TEXT = {
    "scheduling_policy": "priority",
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
    "lora_modules": ["a=/adapters/a"],
    "device": "cpu",
    "attention_backend": "torch",
    "local_address": "10.0.0.2",
    "cuda_graph_sizes": "1,2",
    "kv_offload_disk": "/var/kv",
    "kv_transfer_host": "0.0.0.0",
    "int8_act_bits": "8",
    "priority_ranges": "realtime=80-100,batch=20-40",
    "extra_modules": ["vision_encoder"],
    "limit_mm_per_prompt": "image=2",
    "allowed_local_media_path": "/srv/images",
}
NEEDS = {"lora_modules": {"enable_lora": True}}


def other_value(e: Entry, current: Any = None) -> Any:
    """A valid value of the setting other than `current` (default: its default)."""
    default = getattr(e.default, "value", e.default) if current is None else current
    if e.name in TEXT:
        return TEXT[e.name]
    if e.kind is bool:
        return not default
    if e.spec.choices is not None:
        return next(c for c in e.spec.choices if c != default)
    bounds = e.spec.bounds
    value = (default if default is not None else 0) + (1 if e.kind is int else 0.25)
    if bounds is not None and not bounds.contains(value):
        value = (default or 0) - (1 if e.kind is int else 0.25)
    assert bounds is None or bounds.contains(value), e.name
    return value


def test_every_engine_and_worker_setting_is_an_llm_keyword_that_reaches_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for e in walk(EngineSettings):
        if e.spec.env:
            monkeypatch.delenv(e.spec.env, raising=False)
    parameters = inspect.signature(LLM).parameters
    baseline = flat_values(engine_settings({}))
    entries = list(walk(EngineSettings))
    assert len(entries) > 50
    for e in entries:
        assert e.name in parameters and parameters[e.name].default == e.default, e.name
        value = other_value(e, baseline[e.name])
        built = flat_values(engine_settings({e.name: value, **NEEDS.get(e.name, {})}))
        assert built[e.name] != baseline[e.name], f"{e.name}={value!r} changed nothing"
        others = {k for k in built if built[k] != baseline[k]} - {e.name, *NEEDS.get(e.name, {})}
        assert not others - {"kv_compact_fraction"}, f"{e.name} changed {others}"  # under pressure: its pool


def test_a_setting_reaches_its_group() -> None:
    settings = engine_settings({"watermark": 0.2, "kv_cache_memory": "4GiB", "worker_rejoin_timeout": 5})
    assert settings.engine.scheduler.watermark == 0.2
    assert settings.worker.kv_cache_memory == 4 * 2**30
    assert settings.engine.options.rejoin_timeout == 5


def test_the_scheduler_command_line_builds_what_the_same_keywords_build() -> None:
    parser = scheduler_parser()
    assert engine_config(parser.parse_args([])) == engine_settings({}).engine
    for e in walk(EngineConfig):
        if not e.spec.flag:
            continue
        values = {e.name: other_value(e), **NEEDS.get(e.name, {})}
        args = parser.parse_args(to_argv([Part(EngineConfig)], values))
        assert engine_config(args) == engine_settings(values).engine, e.name


def test_the_serving_values_hold_for_both_doors() -> None:
    assert engine_config(scheduler_parser().parse_args([])).options.schedule_gc
    assert engine_settings({}).engine.options.schedule_gc
    assert not EngineConfig().options.schedule_gc, "an engine built bare (the tests') leaves it off"


@pytest.mark.parametrize("key", ["max_num_seq", "scheduler_address", "zmq_curve_dir", "model"])
def test_an_unknown_keyword_is_a_type_error_naming_it(key: str) -> None:
    with pytest.raises(TypeError, match=f"unknown setting '{key}'"):
        engine_settings({key: 1})
    if key != "model":
        with pytest.raises(TypeError, match=f"unknown setting '{key}'"):
            LLM("no-such-model", **{key: 1})  # type: ignore[arg-type]  # refused before any model is looked for


def test_a_value_out_of_range_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        LLM("no-such-model", max_num_seqs=0)
    assert {e.name for e in walk(WorkerOptions)} - {e.name for e in walk(EngineSettings)} == {
        "scheduler_address",
        "zmq_curve_dir",
    }
