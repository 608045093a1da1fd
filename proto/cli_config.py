"""`--config FILE.yaml` for every command: each flag has a key (`--max-num-seqs` ↔ `max_num_seqs`); flags win."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

import yaml


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of settings; keys are the long flag names (dashes or underscores); flags win",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    pre, _ = parser.parse_known_args(argv)
    if getattr(pre, "config", None):
        parser.set_defaults(**_load(parser, Path(pre.config)))
    return parser.parse_args(argv)


def _load(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"cannot read config {path}: {exc}")
    if not isinstance(data, dict):
        parser.error(f"config {path} must be a mapping of flag names to values")
    known = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = known.get(dest)
        if action is None:
            parser.error(f"unknown key {key!r} in {path}; valid keys: {', '.join(sorted(known))}")
        convert = action.type
        if callable(convert) and value is not None and not isinstance(value, bool):
            try:
                value = convert(value) if not isinstance(value, list) else [convert(v) for v in value]
            except (TypeError, ValueError) as exc:
                parser.error(f"{key} in {path}: {exc}")
        if action.choices is not None and value not in action.choices:
            parser.error(f"{key} in {path}: {value!r} is not one of {list(action.choices)}")
        values[dest] = value
    return values
