"""The engine's settings from flat keyword arguments: `LLM(...)`'s keywords and vllm-scheduler's engine flags both
come through `engine_settings`, so that a setting added to the tree reaches both (and a later
`AsyncEngineArgs`) with no edit here."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from settings.build import build
from settings.engine import EngineConfig
from settings.setting import group, walk
from settings.worker import WorkerOptions

# What an engine behind a door runs with where the dataclass default suits an engine built bare (the tests').
SERVING: dict[str, Any] = {"schedule_gc": True}


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """An engine core and its workers: what `LLM(...)` takes (its workers join it on loopback, so it names no
    scheduler address and no CURVE keys)."""

    engine: EngineConfig = group(EngineConfig)
    worker: WorkerOptions = group(WorkerOptions, skip=("scheduler_address", "zmq_curve_dir"))


def keyword_parameters() -> list[inspect.Parameter]:
    """Every setting of EngineSettings as a keyword-only parameter with its default and type (a signature's)."""
    return [
        inspect.Parameter(e.name, inspect.Parameter.KEYWORD_ONLY, default=e.default, annotation=e.kind)
        for e in walk(EngineSettings)
    ]


def engine_settings(values: Mapping[str, Any]) -> EngineSettings:
    """The settings of these flat values (`max_num_seqs`, `kv_cache_memory`, ...), the rest from the environment
    overrides or the defaults. TypeError naming an unknown key; ValueError naming a value out of range."""
    return build(EngineSettings, {**SERVING, **values})
