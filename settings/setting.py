"""One setting, written once: a dataclass field whose metadata holds what every derived form needs.

A group of settings is a frozen dataclass whose fields are `setting(...)`s (leaves) or `group(...)`s (a nested
group, flattened into its parent's names). From a field's `Spec` come its command-line flag (settings/cli.py), its
config-file key (the flag's name, settings/config_file.py), its keyword for `LLM(...)` (settings/build.py), its row
in docs/settings.md (settings/table.py) and its range check (`check`, which each group's `__post_init__` calls
before its cross-field checks).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Who reads a setting: the process (or API) whose code uses its value.
READERS = ("scheduler", "worker", "router", "serve", "client", "monitor", "bench", "convert")
_SPEC, _GROUP = "setting", "group"
KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True, slots=True)
class Bounds:
    """A number's valid range: `low`/`high` inclusive, `above`/`below` exclusive (None: unbounded)."""

    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None

    def contains(self, value: float) -> bool:
        return (
            (self.low is None or value >= self.low)
            and (self.high is None or value <= self.high)
            and (self.above is None or value > self.above)
            and (self.below is None or value < self.below)
        )

    def describe(self) -> str:
        """'>= 1', '> 0', 'in [0, 1)', ..."""
        lower = (f"[{self.low:g}", f">= {self.low:g}") if self.low is not None else None
        lower = (f"({self.above:g}", f"> {self.above:g}") if self.above is not None else lower
        upper = (f"{self.high:g}]", f"<= {self.high:g}") if self.high is not None else None
        upper = (f"{self.below:g})", f"< {self.below:g}") if self.below is not None else upper
        if lower and upper:
            return f"in {lower[0]}, {upper[0]}"
        return (lower or upper or ("", "any"))[1]


@dataclass(frozen=True, slots=True)
class Spec:
    """What a setting is, beyond its field's name, type and default (see `setting`)."""

    help: str
    readers: tuple[str, ...]
    name: str = ""
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    bounds: Bounds | None = None
    env: str = ""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    flag: bool = True
    repeat: str = ""
    required: bool = False


def setting(
    default: Any,
    *,
    help: str,
    readers: tuple[str, ...] | str,
    name: str = "",
    aliases: tuple[str, ...] = (),
    choices: tuple[Any, ...] | None = None,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    below: float | None = None,
    env: str = "",
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    flag: bool = True,
    repeat: str = "",
    required: bool = False,
) -> Any:
    """A field that is a setting.

    `name`: its key everywhere (keyword, config key, `--flag` with dashes); default the field's name.
    `aliases`: more long flags (a former name). `choices` / `low`, `high` (inclusive) / `above`, `below`
    (exclusive): its valid values, checked by `check` (and by argparse for choices). `readers`: which process uses
    it (READERS). `env`: an environment variable that overrides the default where settings are read (a command's
    start, `LLM(...)`). `parse`: text to value (a flag's argparse type, an environment value, a string keyword);
    default the field's type. `flag=False`: no command-line flag (Python only). `repeat`: `append` (the flag again
    adds one), `+` (one flag, several values) or `extend` (both). `required`: the command needs it.
    """
    readers = (readers,) if isinstance(readers, str) else readers
    unknown = set(readers) - set(READERS)
    if unknown:
        raise ValueError(f"readers: {sorted(unknown)} are not among {READERS}")
    bounds = Bounds(low, high, above, below) if (low, high, above, below) != (None,) * 4 else None
    spec = Spec(help, readers, name, aliases, choices, bounds, env, metavar, parse, flag, repeat, required)
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def group(cls: type, skip: tuple[str, ...] = ()) -> Any:
    """A field holding a nested group, whose settings are named as if they were its parent's; `skip`: names the
    parent does not take (their defaults stay)."""
    return dataclasses.field(default_factory=cls, metadata={_GROUP: (cls, skip)})


@dataclass(frozen=True, slots=True)
class Entry:
    """One setting as a group declares it: its field, its resolved name, type and default."""

    owner: type
    field: str
    name: str
    kind: type  # int, float, str or bool (a str enum: str); a value type with its own `parse` otherwise
    optional: bool  # None is a valid value
    items: bool  # a tuple of values (repeatable)
    default: Any
    spec: Spec

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def text_to_value(self, text: str) -> Any:
        """An environment variable's or a string keyword's value as this setting's type."""
        if self.spec.parse is not None:
            return self.spec.parse(text)
        if self.kind is bool:
            return parse_bool(text)
        return self.kind(text)


def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {text!r}")


_ENTRIES: dict[type, tuple[Entry, ...]] = {}  # a group's, read once (its type hints resolved)


def entries(cls: type) -> tuple[Entry, ...]:
    """The settings a group declares itself (not its nested groups')."""
    found = _ENTRIES.get(cls)
    if found is None:
        found = _ENTRIES[cls] = _entries(cls)
    return found


def _entries(cls: type) -> tuple[Entry, ...]:
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_SPEC)
        if spec is None:
            continue
        kind, optional, items = _kind(hints[f.name])
        found.append(Entry(cls, f.name, spec.name or f.name, kind, optional, items, f.default, spec))
    return tuple(found)


def subgroups(cls: type) -> tuple[tuple[str, type, tuple[str, ...]], ...]:
    """(field, group, names skipped) of each nested group."""
    return tuple((f.name, *f.metadata[_GROUP]) for f in dataclasses.fields(cls) if _GROUP in f.metadata)


def walk(cls: type, skip: tuple[str, ...] = ()) -> Iterator[Entry]:
    """Every setting of a group and of its nested groups, but those named in `skip`."""
    for entry in entries(cls):
        if entry.name not in skip:
            yield entry
    for _, sub, sub_skip in subgroups(cls):
        yield from walk(sub, skip + sub_skip)


def _kind(hint: Any) -> tuple[type, bool, bool]:
    """(kind, optional, items) of a field's type: `int | None` is (int, True, False), `tuple[str, ...]` is
    (str, False, True)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return _kind(typing.get_args(hint)[0])[0], optional, True
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and issubclass(hint, str):
        return str, optional, False
    return hint, optional, False


class SettingError(ValueError):
    """A setting's value of the wrong type or outside its choices or range; named as a keyword (`max_num_seqs`),
    or as its flag (`as_flag`) where it came from a command line."""

    def __init__(self, entry: Entry, problem: str, value: Any) -> None:
        self.entry, self.problem, self.value = entry, problem, value
        super().__init__(f"{entry.name} must be {problem}, got {value!r}")

    def as_flag(self) -> str:
        return f"{self.entry.flag} must be {self.problem}, got {self.value!r}"


def check(settings: object) -> None:
    """SettingError naming the first setting of this group (not its nested groups) whose value has the wrong type
    or lies outside its choices or range."""
    for entry in entries(type(settings)):
        value = getattr(settings, entry.field)
        problem = _problem(entry, value)
        if problem:
            raise SettingError(entry, problem, value)


def _problem(entry: Entry, value: Any) -> str:
    kind = KIND_WORDS.get(entry.kind, f"a {entry.kind.__name__}")
    if value is None:
        return "" if entry.optional else kind
    values = value if entry.items else (value,)
    if entry.items and not isinstance(value, tuple):
        return "a tuple"
    for v in values:
        if not _has_kind(v, entry.kind):
            return kind
        if entry.spec.choices is not None and v not in entry.spec.choices:
            return "one of " + ", ".join(str(c) for c in entry.spec.choices)
        if entry.spec.bounds is not None and not entry.spec.bounds.contains(v):
            return entry.spec.bounds.describe()
    return ""


def _has_kind(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
