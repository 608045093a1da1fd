"""`--config FILE.yaml` for every command: each flag has a key (`--max-num-seqs` ↔ `max_num_seqs`); flags win.

A repeatable flag (`--metric`, `--stop`) takes a list (or one value) in the file, and the command line adds to
it rather than replacing it; a required flag may come from the file alone. `null` keeps the command's default
(for `control-token`, that is `$MINIVLLM_CONTROL_TOKEN`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

import yaml

from proto.attention_setting import from_mapping
from proto.nesting import TooDeep, parse_nested


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of settings; keys are the long flag names (dashes or underscores); flags win, "
        "repeatable flags add to the file's list",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    pre, _ = _parse_known_without_required(parser, argv)
    if getattr(pre, "config", None):
        values = _load(parser, Path(pre.config))
        parser.set_defaults(**values)
        for action in parser._actions:
            if action.dest in values:
                action.required = False  # the file gave it
    return parser.parse_args(argv)


def config_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a config file for this parser may hold: the long flags' names with underscores (a flag's first
    name: the setting's, or the command's own spelling of it, as vllm-serve's `port` is its HTTP port)."""
    return {
        a.option_strings[0][2:].replace("-", "_"): a
        for a in parser._actions
        if a.option_strings and a.dest not in ("help", "config")
    }


def _alias_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The keys of a flag's other long names (`--drain-timeout` for `--shutdown-timeout`): a file may use them."""
    keys = config_keys(parser)
    return {
        name[2:].replace("-", "_"): a
        for a in keys.values()
        for name in a.option_strings
        if name.startswith("--") and name[2:].replace("-", "_") not in keys
    }


def _parse_known_without_required(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """Find --config before argparse insists on flags that the file may provide."""
    required = [a for a in parser._actions if a.required]
    for action in required:
        action.required = False
    try:
        return parser.parse_known_args(argv)
    finally:
        for action in required:
            action.required = True


def _load(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    try:
        data = parse_nested(yaml.safe_load, path.read_text(), "its YAML") or {}
    except (OSError, yaml.YAMLError, TooDeep) as exc:
        parser.error(f"cannot read config {path}: {exc}")
    if not isinstance(data, dict):
        parser.error(f"config {path} must be a mapping of flag names to values")
    known = config_keys(parser)
    aliases = _alias_keys(parser)
    if "engine" in data and "quantization" in known:  # the article's engine.mixed_precision section
        data = _with_mixed_precision(parser, path, data)
    if "gpu_topology" in data or isinstance(data.get("scheduling_policy"), dict):  # the scheduler article's template
        data = _with_topology(parser, path, data)
    if "attention" in data and "attention_backend" in known:  # the article's model config section
        data = _with_attention(parser, path, data)
    if "kv_block_bytes" in known:  # article 000's `block_size: 16KB`
        data = _with_block_bytes(parser, path, data)
    if "model_loader" in data and "extra_modules" in known:  # the article's multimodal section
        data = _with_model_loader(parser, path, data)
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}  # dest -> the key that set it
    for key, value in data.items():
        action = known.get(str(key).replace("-", "_")) or aliases.get(str(key).replace("-", "_"))
        if action is None:
            parser.error(f"unknown key {key!r} in {path}; valid keys: {', '.join(sorted(known))}")
        dest = action.dest
        if dest in keys:
            parser.error(f"{path}: {keys[dest]!r} and {key!r} are one setting ({action.option_strings[0]}); keep one")
        keys[dest] = str(key)
        if value is None:
            continue  # null: the command's own default
        repeatable = isinstance(action, argparse._AppendAction)
        if repeatable and not isinstance(value, list):
            value = [value]
        convert = action.type
        if callable(convert) and not isinstance(value, bool):
            try:
                value = [convert(v) for v in value] if isinstance(value, list) else convert(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{key} in {path}: {exc}")
        many = repeatable or (action.nargs in ("+", "*") and isinstance(value, list))  # a list of choices
        if action.choices is not None and not all(v in action.choices for v in (value if many else [value])):
            parser.error(f"{key} in {path}: {value!r} is not one of {list(action.choices)}")
        values[dest] = value
    return values


def _with_block_bytes(parser: argparse.ArgumentParser, path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with a `block_size` given in bytes (`16KB`) as the `kv_block_bytes` it stands for (resolved to tokens
    once the model is known: settings/scheduler.py)."""
    from settings.units import has_byte_unit

    found = [k for k, v in data.items() if str(k).replace("-", "_") == "block_size" and has_byte_unit(v)]
    if not found:
        return data
    if any(str(k).replace("-", "_") == "kv_block_bytes" for k in data):
        parser.error(f"{path}: block_size {data[found[0]]} and kv_block_bytes both size a KV block; keep one")
    return {("kv_block_bytes" if k in found else k): v for k, v in data.items()}


def _with_model_loader(parser: argparse.ArgumentParser, path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its `model_loader:` section (`extra_modules: [vision_encoder, ...]`) replaced by the
    `extra_modules` setting; any other key of the section is refused by name."""
    section, rest = data["model_loader"], {k: v for k, v in data.items() if k != "model_loader"}
    if not isinstance(section, dict):
        parser.error(f"{path}: model_loader must be a mapping (extra_modules: [...])")
    unknown = [k for k in section if k != "extra_modules"]
    if unknown:
        parser.error(f"{path}: model_loader.{unknown[0]} is not a key of model_loader (extra_modules)")
    if "extra_modules" in rest:
        parser.error(f"{path}: model_loader.extra_modules and extra_modules both name the modules; keep one")
    return {**rest, "extra_modules": section.get("extra_modules")}


def _with_attention(parser: argparse.ArgumentParser, path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its `attention:` section (`type`, and a compiled kernel's `library` and `params`) replaced by the
    `attention_backend` setting it stands for (proto/attention_setting.py)."""
    rest = {k: v for k, v in data.items() if k != "attention"}
    if any(str(k).replace("-", "_") == "attention_backend" for k in rest):
        parser.error(f"{path}: attention and attention_backend both choose the attention backend; keep one")
    try:
        choice = from_mapping(data["attention"])
    except ValueError as exc:
        parser.error(f"{path}: {exc}")
    if choice.compiled and not choice.library:
        parser.error(
            f"{path}: attention.library: give the path of the shared library of kernel {choice.type!r} (a "
            "command has no registered kernels)"
        )
    return {**rest, "attention_backend": choice.setting()}


def _with_mixed_precision(parser: argparse.ArgumentParser, path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its `engine:` section replaced by the flags it stands for; a flat key naming the same flag
    with another value is refused (two answers to one question)."""
    from settings.mixed_precision import MixedPrecisionError, mixed_precision_flags

    rest = {k: v for k, v in data.items() if k != "engine"}
    try:
        flags = mixed_precision_flags(
            data["engine"], rest.get("device", "auto") if "device" in config_keys(parser) else None
        )
    except MixedPrecisionError as exc:
        parser.error(f"{path}: {exc}")
    for dest, value in flags.items():
        if dest not in config_keys(parser):
            parser.error(f"{path}: engine.mixed_precision sets {dest}, a flag of the workers (--kv-cache-dtype) here")
        given = next((v for k, v in rest.items() if str(k).replace("-", "_") == dest), None)
        if given is not None and str(given) != value:
            parser.error(f"{path}: engine.mixed_precision says {dest} {value}, the key {dest} says {given}")
    return rest | flags


def _with_topology(parser: argparse.ArgumentParser, path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with `gpu_topology` and a `scheduling_policy` mapping replaced by the settings they stand for
    (settings/topology.py); a key of another command, or a flat key saying otherwise, is refused naming it."""
    from settings.topology import GPU_TOPOLOGY, TopologyKeyError, policy_values, topology_value

    known = config_keys(parser)
    policy = data.get("scheduling_policy")
    rest = {
        k: v
        for k, v in data.items()
        if k != GPU_TOPOLOGY and not (k == "scheduling_policy" and isinstance(policy, dict))
    }
    values: dict[str, Any] = {}
    try:
        if GPU_TOPOLOGY in data:
            if "topology" in rest:
                raise TopologyKeyError(f"{GPU_TOPOLOGY} and topology both give the devices; keep one")
            values["topology"] = topology_value(data[GPU_TOPOLOGY], rest.get("device", "auto"))
        if isinstance(policy, dict):
            values |= policy_values(policy)
    except TopologyKeyError as exc:
        parser.error(f"{path}: {exc}")
    for dest, value in values.items():
        key = (
            GPU_TOPOLOGY
            if dest == "topology"
            else f"scheduling_policy.{dest.replace('routing_strategy', 'cross_device')}"
        )
        if dest not in known:
            parser.error(f"{path}: {key} is for the data-parallel replicas of vllm-serve; {parser.prog} runs one")
        given = next((v for k, v in rest.items() if str(k).replace("-", "_") == dest), None)
        if given is not None and given != value:
            parser.error(f"{path}: {key} sets {dest} {value}, the key {dest} says {given}")
    return rest | values
