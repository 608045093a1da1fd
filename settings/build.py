"""A group from flat values (`LLM(...)`'s keywords, a command line's namespace), and back.

Every setting of a group and of its nested groups has one flat name (`kv_compact_fraction`, not
`kv_compact.fraction`), so a caller never needs to know which group holds it: `build(EngineSettings, values)`
places each value in its group, takes the environment override of a setting not given, and leaves the rest at
their defaults. An unknown name is a TypeError naming it, as a wrong keyword argument is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

from settings.setting import Entry, entries, subgroups, walk

G = TypeVar("G")


def names(cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    """The flat names of a group's settings (nested groups' included)."""
    return [e.name for e in walk(cls, skip)]


def build(cls: type[G], values: Mapping[str, Any], env: Mapping[str, str] | None = None) -> G:
    """The group with these values; a setting not in `values` takes its environment override (`env`, default
    os.environ), else its default. TypeError for a name the group does not have; ValueError (from the groups'
    checks) for a value out of range."""
    known = set(names(cls))
    unknown = [key for key in values if key not in known]
    if unknown:
        raise TypeError(f"unknown setting {unknown[0]!r}")
    return _build(cls, values, os.environ if env is None else env, ())


def _build(cls: type[G], values: Mapping[str, Any], env: Mapping[str, str], skip: tuple[str, ...]) -> G:
    given: dict[str, Any] = {}
    for entry in entries(cls):
        if entry.name in skip:
            continue
        if entry.name in values:
            given[entry.field] = coerce(entry, values[entry.name])
        elif entry.spec.env and entry.spec.env in env:
            given[entry.field] = env_value(entry, env[entry.spec.env])
    for field, sub, sub_skip in subgroups(cls):
        given[field] = _build(sub, values, env, skip + sub_skip)
    return cls(**given)


def coerce(entry: Entry, value: Any) -> Any:
    """A value as its setting holds it: text parsed where the setting is not text (`"4GiB"` for a byte count), a
    list of a repeatable setting as a tuple, each of its items parsed when text."""
    if entry.items and isinstance(value, (list, tuple)):
        return tuple(_item(entry, v) for v in value)
    return _item(entry, value)


def _item(entry: Entry, value: Any) -> Any:
    if isinstance(value, str) and (entry.kind is not str or entry.spec.parse is not None):
        return entry.text_to_value(value)
    return value


def env_value(entry: Entry, text: str) -> Any:
    """An environment override's value; ValueError naming the variable when it cannot be read."""
    try:
        return coerce(entry, entry.text_to_value(text))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"${entry.spec.env}: {exc}") from None


def flat_values(settings: object, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A group's values by flat name (its nested groups' included): what `build` takes back."""
    values = {e.name: getattr(settings, e.field) for e in entries(type(settings)) if e.name not in skip}
    for field, _, sub_skip in subgroups(type(settings)):
        values |= flat_values(getattr(settings, field), skip + sub_skip)
    return values


def defaults(cls: type) -> dict[str, Any]:
    """Each setting's default by flat name (the dataclass's, not the environment's)."""
    return {e.name: e.default for e in walk(cls)}
