"""docs/settings.md from the tree: per group, a table of its settings (flag, default, valid values, environment
override, which process reads it, help), and which commands and `LLM(...)` take each group.

    python -m settings.table > docs/settings.md

tests/settings/test_table.py checks that the committed file is what this prints.
"""

from __future__ import annotations

import enum
import inspect
import sys
from typing import Any

from settings.cli import Part, sections, title
from settings.commands import COMMANDS
from settings.engine_args import EngineSettings
from settings.setting import Entry, entries

LLM = "LLM(...)"
HEADER = """# Settings

Generated from the settings tree (`settings/`) by `python -m settings.table > docs/settings.md`; do not edit it by
hand (`tests/settings/test_table.py` checks it is current). Each setting is a flag of the commands that take its
group (`--max-num-seqs`), the same key in their `--config FILE.yaml` (`max_num_seqs` or `max-num-seqs`), and, for
the engine's and the workers' settings, a keyword of `LLM(...)` (`LLM(max_num_seqs=8)`). A setting with an
environment variable takes its value from it where the variable is set and the flag or keyword is not.
"""


def render() -> str:
    takers = _takers()
    lines = [HEADER, "| command | groups |", "| --- | --- |"]
    for command, parts in _uses():
        lines.append(f"| `{command}` | " + ", ".join(f"`{cls.__name__}`" for cls, _ in sections(parts)) + " |")
    for cls, found in _groups():
        module = inspect.getsourcefile(cls) or ""
        path = module[module.rindex("settings/") :] if "settings/" in module else module
        lines += ["", f"## `{cls.__name__}`: {title(cls)}", "", f"In `{path}`; taken by {', '.join(takers[cls])}.", ""]
        lines += ["| setting | default | values | read by | what it does |", "| --- | --- | --- | --- | --- |"]
        lines += [_row(e) for e in found]
    return "\n".join(lines) + "\n"


def _uses() -> list[tuple[str, tuple[Part, ...]]]:
    return [(name, c.parts) for name, c in COMMANDS.items()] + [(LLM, (Part(EngineSettings),))]


def _groups() -> list[tuple[type, list[Entry]]]:
    """Every group once, in the order the commands first take them."""
    seen: dict[type, list[Entry]] = {}
    for _, parts in _uses():
        for cls, found in sections(parts):
            mine = seen.setdefault(cls, [])
            mine += [e for e in found if e not in mine]
    return list(seen.items())


def _takers() -> dict[type, list[str]]:
    """Who takes each group: the commands, and `LLM(...)`, each with the part it takes where not the whole."""
    takers: dict[type, list[str]] = {}
    for command, parts in _uses():
        own = COMMANDS[command].defaults if command in COMMANDS else {}
        spelled = COMMANDS[command].spellings if command in COMMANDS else {}
        for cls, found in sections(parts):
            missing = [e for e in entries(cls) if e not in found]
            notes = [f"`{_name(e)}` default `{own[e.name]}`" for e in found if e.name in own]
            notes += [
                f"`{_name(e)}` spelled " + " or ".join(f"`{f}`" for f in spelled[e.name].flags)
                for e in found
                if e.name in spelled
            ]
            if missing:
                some = found if len(found) < len(missing) else missing
                notes.insert(0, ("only " if some is found else "all but ") + ", ".join(f"`{_name(e)}`" for e in some))
            takers.setdefault(cls, []).append(f"`{command}`" + (f" ({'; '.join(notes)})" if notes else ""))
    return takers


def _name(e: Entry) -> str:
    return e.flag if e.spec.flag else e.name


def _row(e: Entry) -> str:
    spec = e.spec
    names = [_name(e), *("--" + a.replace("_", "-") for a in spec.aliases)]
    setting = " ".join(f"`{n}`" for n in names) + ("" if spec.flag else " (no flag)")
    if spec.env:
        setting += f" `${spec.env}`"
    values = _values(e)
    cells = [setting, _show(e.default), values, ", ".join(spec.readers), spec.help]
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _values(e: Entry) -> str:
    spec = e.spec
    if spec.choices is not None:
        kinds = ", ".join(str(_show_plain(c)) for c in spec.choices)
    elif e.kind is bool:
        kinds = f"`{e.flag}` / `--no-{e.flag[2:]}`" if spec.flag else "true, false"
    else:
        kinds = {int: "integer", float: "number", str: "text"}.get(e.kind, e.kind.__name__)
        if spec.bounds is not None:
            kinds += f" {spec.bounds.describe()}"
    if e.items:
        kinds += " (repeatable)"
    return kinds + (", required" if spec.required else "")


def _show(value: Any) -> str:
    if value is None or value == ():
        return "—"
    return f"`{_show_plain(value)}`" if value != "" else '`""`'


def _show_plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


if __name__ == "__main__":
    sys.stdout.write(render())
