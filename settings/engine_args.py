"""The engine's settings from flat keyword arguments: `LLM(...)`'s keywords and vllm-scheduler's engine flags both
come through `engine_settings`, so that a setting added to the tree reaches both (and `AsyncEngineArgs`) with no
edit here. A setting's aliases (`max_batch_size` for `max_num_seqs`, the articles' names) are keywords too."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from settings.build import build, coerce
from settings.engine import EngineConfig
from settings.setting import SettingError, group, walk
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


def alias_names() -> dict[str, str]:
    """Each alias of an engine or worker setting, and the setting's name (`max_batch_size` -> `max_num_seqs`)."""
    return {alias: e.name for e in walk(EngineSettings) for alias in e.spec.aliases}


def alias_parameters() -> list[inspect.Parameter]:
    """Every alias as a keyword-only parameter (default None: not given), for a signature that shows them."""
    return [inspect.Parameter(alias, inspect.Parameter.KEYWORD_ONLY, default=None) for alias in sorted(alias_names())]


def engine_settings(values: Mapping[str, Any]) -> EngineSettings:
    """The settings of these flat values (`max_num_seqs`, `kv_cache_memory`, ...; an alias such as
    `max_batch_size` for its setting), the rest from the environment overrides or the defaults. TypeError naming an
    unknown key or a setting given twice (by name and alias); ValueError naming a value out of range, as the caller
    spelled it."""
    named, spelled = canonical(values)
    entries = {e.name: e for e in walk(EngineSettings)}
    for name, value in named.items():  # text that does not parse, named as given (build's message names no key)
        if name in entries:
            try:
                coerce(entries[name], value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{spelled.get(name, name)}: {exc}") from None
    try:
        return build(EngineSettings, {**SERVING, **named})
    except SettingError as exc:
        if exc.entry.name not in spelled:
            raise
        raise ValueError(f"{spelled[exc.entry.name]} must be {exc.problem}, got {exc.value!r}") from None


def canonical(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`values` with each alias replaced by its setting's name (an alias given None counts as not given), and the
    alias each such setting was given by."""
    aliases = alias_names()
    named: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in values.items():
        name = aliases.get(key, key)
        if name != key and value is None:
            continue
        if name in named:
            raise TypeError(f"{spelled.get(name, name)!r} and {key!r} name the same setting ({name}); give one")
        named[name] = value
        if name != key:
            spelled[name] = key
    return named, spelled
