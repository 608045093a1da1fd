"""Command lines from the settings tree: a command's parser from its groups, a group back from the parsed flags,
and the flags that hand settings on to a child process (vllm-serve's scheduler and workers, `LLM`'s workers).

A flag is its setting's name with dashes (`max_num_seqs` -> `--max-num-seqs`); a switch also has its `--no-` form;
a setting's choices, type and help are its Spec's. Each group is a section of --help, titled by its docstring.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from settings.build import build, env_value
from settings.setting import Entry, SettingError, entries, subgroups

G = TypeVar("G")


class DuplicateSetting(ValueError):
    """Two different settings of one command have the same name or flag."""


@dataclass(frozen=True, slots=True)
class Part:
    """A group as a command takes it: all of it, `only` some of its settings, or all but those it `skip`s (settings
    the command sets itself, as vllm-serve does its workers' --scheduler-address)."""

    group: type
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()

    def takes(self, entry: Entry) -> bool:
        return entry.name not in self.skip and (not self.only or entry.name in self.only)


def sections(parts: Iterable[Part]) -> list[tuple[type, list[Entry]]]:
    """The settings of these parts by the group that declares them, each once (a group two parts reach is one
    group); DuplicateSetting when two different settings share a name or a flag."""
    by_group: dict[type, list[Entry]] = {}
    seen: dict[str, Entry] = {}
    for part in parts:
        for cls, found in _groups(part.group, part.skip):
            for entry in found:
                if not part.takes(entry):
                    continue
                for key in (entry.name, *entry.spec.aliases):
                    other = seen.setdefault(key, entry)
                    if other != entry:
                        raise DuplicateSetting(
                            f"setting {key!r} is defined twice: {other.owner.__name__}.{other.field} and "
                            f"{entry.owner.__name__}.{entry.field}"
                        )
                mine = by_group.setdefault(cls, [])
                if entry not in mine:
                    mine.append(entry)
    return [(cls, found) for cls, found in by_group.items() if found]


def _groups(cls: type, skip: tuple[str, ...]) -> list[tuple[type, list[Entry]]]:
    found = [(cls, [e for e in entries(cls) if e.name not in skip])]
    for _, sub, sub_skip in subgroups(cls):
        found += _groups(sub, skip + sub_skip)
    return found


class CommandParser(argparse.ArgumentParser):
    """A command's parser that builds its groups from what it parsed: a value out of range, or two that do not go
    together, is a usage error naming the flag, as a malformed value is (whether it came from the command line, a
    config file or the environment)."""

    def __init__(self, *args: Any, parts: Sequence[Part] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parts = tuple(parts)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        for part in self.parts:
            try:
                from_args(part.group, parsed)
            except ValueError as exc:
                self.error(str(exc))
        return parsed


@dataclass(frozen=True, slots=True)
class Spelling:
    """A command's own flags for a setting, where they are not the setting's name (vllm-serve's `--port` is the
    HTTP port, as in vLLM, while the setting `port` is gRPC's): the flags (the first is its config key), and a
    note added to its help."""

    flags: tuple[str, ...]
    note: str = ""

    def __post_init__(self) -> None:
        if not self.flags or not all(f.startswith("--") for f in self.flags):
            raise ValueError(f"a spelling's flags are long flags (--name), got {self.flags}")


def add_settings(
    parser: argparse.ArgumentParser,
    parts: Sequence[Part],
    defaults: Mapping[str, Any] | None = None,
    spellings: Mapping[str, Spelling] | None = None,
) -> None:
    """A flag for every setting of `parts` (those with one), a section of --help per group; `defaults`: the
    command's own defaults, by name (vllm-serve's --openai-port); `spellings`: its own flags, by name."""
    for cls, found in sections(parts):
        section = parser.add_argument_group(title(cls))
        for entry in found:
            if entry.spec.flag:
                default = (defaults or {}).get(entry.name, _default(parser, entry))
                _add(parser, section, entry, default, (spellings or {}).get(entry.name))


def title(cls: type) -> str:
    """A group's heading: its docstring's first line."""
    return (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")


def _default(parser: argparse.ArgumentParser, entry: Entry) -> Any:
    """The setting's default, or its environment override where set (read now: the command's start)."""
    if entry.spec.env and entry.spec.env in os.environ:
        try:
            return env_value(entry, os.environ[entry.spec.env])
        except ValueError as exc:
            parser.error(str(exc))
    return entry.default


def _add(parser: argparse.ArgumentParser, section: Any, entry: Entry, default: Any, spelling: Spelling | None) -> None:
    spec = entry.spec
    flags = list(spelling.flags) if spelling else [entry.flag, *("--" + a.replace("_", "-") for a in spec.aliases)]
    text = help_text(entry) + (f" [{spelling.note}]" if spelling and spelling.note else "")
    metavar = spec.metavar or (spelling.flags[0][2:].upper().replace("-", "_") if spelling else None)
    options: dict[str, Any] = {"dest": entry.name, "help": text, "metavar": metavar}
    if spec.required:
        options["required"] = True
    else:
        options["default"] = _plain(default)
    if entry.kind is bool and not entry.items:
        options["action"] = argparse.BooleanOptionalAction
        options.pop("metavar")
    else:
        options["type"] = _argparse_type(spec.parse) if spec.parse else entry.kind
        if spec.choices is not None:
            options["choices"] = list(spec.choices)
    if entry.items:
        options |= {"append": {"action": "append"}, "+": {"nargs": "+"}, "extend": {"action": "extend", "nargs": "+"}}[
            spec.repeat or "append"
        ]
    section.add_argument(*flags, **options)


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as argparse's type: its ValueError's words shown (argparse hides a ValueError's)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def help_text(entry: Entry) -> str:
    """The help of a flag: the setting's, with its environment override named (argparse's % escaped)."""
    text = entry.spec.help
    if entry.spec.env and f"${entry.spec.env}" not in text:
        text += f" [env ${entry.spec.env}]"
    return text.replace("%", "%%")


def _plain(value: Any) -> Any:
    """A default as argparse holds it: an enum's value, a tuple as a list (append adds to it)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


def from_args(cls: type[G], args: argparse.Namespace) -> G:
    """The group from a parsed command line: the flags it has set, the rest at the defaults (or environment).
    ValueError naming the flag whose value is out of range."""
    values = vars(args)
    try:
        return build(cls, {e.name: values[e.name] for _, found in _groups(cls, ()) for e in found if e.name in values})
    except SettingError as exc:
        raise ValueError(exc.as_flag()) from None


def to_argv(parts: Sequence[Part], values: Mapping[str, Any], changed_only: bool = False) -> list[str]:
    """The command-line form of `values` for the settings of `parts` (those in `values` and not None); with
    `changed_only`, only those that differ from their defaults."""
    argv: list[str] = []
    for _, found in sections(parts):
        for entry in found:
            value = values.get(entry.name)
            if not entry.spec.flag or value is None or (changed_only and _plain(value) == _plain(entry.default)):
                continue
            argv += _flag(entry, value)
    return argv


def _flag(entry: Entry, value: Any) -> list[str]:
    if entry.kind is bool and not entry.items:
        return [entry.flag if value else "--no-" + entry.flag[2:]]
    if not entry.items:
        return [entry.flag, str(_plain(value))]
    items = [str(v) for v in value]
    if entry.spec.repeat == "+":  # one flag with every value, or none at all
        return [entry.flag, *items] if items else []
    return [part for item in items for part in (entry.flag, item)]
