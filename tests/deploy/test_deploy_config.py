"""The example configs in deploy/config/: one per command in pyproject's [project.scripts], each holding a key
for every flag of its command (a new flag without a key fails here), each parsed as the command parses it;
flags on the command line win, repeatable flags add to the file's list, null keeps the default."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from settings.commands import SCRIPT_ALIASES
from settings.config_file import config_keys, parse_args
from settings.speculative import speculative_text
from settings.worker import parse_size
from tests.support.paths import REPO

pytestmark = pytest.mark.unit

EXAMPLES = REPO / "deploy" / "config"


def commands() -> dict[str, str]:
    """command name -> module of its entry point, as installed (not a second name of a command: vllm-serving)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items() if name not in SCRIPT_ALIASES}


def parser_of(command: str) -> argparse.ArgumentParser:
    return importlib.import_module(commands()[command]).build_parser()


def example_of(command: str) -> Path:
    return EXAMPLES / f"{command.removeprefix('vllm-')}.yaml"


def file_values(path: Path) -> dict[str, Any]:
    return {str(k).replace("-", "_"): v for k, v in yaml.safe_load(path.read_text()).items()}


COMMANDS = sorted(commands())


def test_every_example_belongs_to_a_command() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(example_of(c).name for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_a_key_in_the_example(command: str) -> None:
    path = example_of(command)
    assert path.is_file(), f"{command} has no example config {path.relative_to(REPO)}"
    missing = sorted(set(config_keys(parser_of(command))) - set(file_values(path)))
    assert not missing, f"{path.relative_to(REPO)} lacks keys for {command} flags: {missing}"


@pytest.mark.parametrize("command", COMMANDS)
def test_the_example_parses_to_its_values(command: str) -> None:
    parser = parser_of(command)
    args = parse_args(parser, ["--config", str(example_of(command))])
    keys = config_keys(parser_of(command))
    for key, value in file_values(example_of(command)).items():
        expected = keys[key].default if value is None else _converted(keys[key], value)
        assert getattr(args, keys[key].dest) == expected, key


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_on_the_command_line_win_over_every_key(command: str) -> None:
    keys = config_keys(parser_of(command))
    for key, value in file_values(example_of(command)).items():
        action = keys[key]
        if isinstance(action, argparse._AppendAction):
            continue  # repeatable: they merge (below)
        argv, expected = _other_value(action, value)
        if not argv:
            continue
        args = parse_args(parser_of(command), ["--config", str(example_of(command)), *argv])
        assert getattr(args, action.dest) == expected, (key, argv)


def test_repeatable_flags_merge_file_and_command_line(tmp_path: Path) -> None:
    monitor = parse_args(parser_of("vllm-monitor"), ["--config", str(example_of("vllm-monitor")), "--metric", "x"])
    assert monitor.metric == [*file_values(example_of("vllm-monitor"))["metric"], "x"]
    config = tmp_path / "client.yaml"
    config.write_text("stop: '.'\n")  # one value stands for a list of one
    client = parse_args(parser_of("vllm-client"), ["--config", str(config), "--stop", "!", "hello"])
    assert client.stop == [".", "!"]


def test_a_required_flag_may_come_from_the_file_alone(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(parser_of("vllm-monitor"), ["--config", str(example_of("vllm-monitor"))])
    assert args.metric == file_values(example_of("vllm-monitor"))["metric"]
    with pytest.raises(SystemExit):
        parse_args(parser_of("vllm-monitor"), [])
    assert "--metric" in capsys.readouterr().err


def test_null_keeps_the_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_CONTROL_TOKEN", "from-env")
    args = parse_args(parser_of("vllm-scheduler"), ["--config", str(example_of("vllm-scheduler"))])
    assert file_values(example_of("vllm-scheduler"))["control_token"] is None
    assert args.control_token == "from-env"


def _converted(action: argparse.Action, value: Any) -> Any:
    if callable(action.type) and not isinstance(value, bool):
        return [action.type(v) for v in value] if isinstance(value, list) else action.type(value)
    return value


def _other_value(action: argparse.Action, value: Any) -> tuple[list[str], Any]:
    """A command line setting `action` to something other than the file's `value`, and what it parses to."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        current = action.default if value is None else value
        return ([f"--no-{flag[2:]}"], False) if current else ([flag], True)
    if isinstance(action, argparse._StoreTrueAction):
        return ([flag], True) if not value else ([], None)  # a store_true flag cannot undo the file's true
    if action.choices is not None:
        other = next(c for c in action.choices if c != value)
        return [flag, str(other)], ([other] if action.nargs == "+" else other)  # a list flag parses to a list
    if action.type is int:
        return [flag, str((value or 0) + 1)], (value or 0) + 1
    if action.type is float:  # another value in range (a fraction stays one)
        other = value / 2 if value else 0.5
        return [flag, str(other)], other
    if action.type is parse_size or getattr(action.type, "__name__", "") == parse_size.__name__:
        return [flag, "3MiB"], 3 * 2**20
    if getattr(action.type, "__name__", "") == "parse_gib":  # GiB, or a size with its unit
        return [flag, "512MiB"], 0.5
    if getattr(action.type, "__name__", "") == "parse_duration":  # seconds, or a duration with its unit
        return [flag, "250ms"], 0.25
    if action.dest == "attention_backend":  # a built-in name or module:Class, checked when parsed
        other = "deploy.custom_attention:PaddedDecodeAttention"
        return [flag, other], other
    if action.dest == "int8_act_bits":  # BITS or PROJECTION=BITS, checked when parsed
        return [flag, "down_proj=8"], "down_proj=8"
    if action.dest == "speculative_config":  # JSON, checked when parsed
        other = '{"method": "ngram", "num_speculative_tokens": 3}'
        return [flag, other], speculative_text(other)
    if action.dest in ("tls_cert", "tls_key"):  # they go together (checked when parsed)
        return ["--tls-cert", "cert.pem", "--tls-key", "key.pem"], f"{action.dest[4:]}.pem"
    if action.dest == "lora_modules":  # name=path, with --enable-lora (checked when parsed)
        return [flag, "a=/adapters/a", "--enable-lora"], ["a=/adapters/a"]
    if action.dest == "limit_mm_per_prompt":  # vLLM's modality=N, checked when parsed
        return [flag, "image=3"], "image=3"
    if action.dest == "priority_ranges":  # NAME=LOW-HIGH,..., checked when parsed
        return [flag, "urgent=90-100"], "urgent=90-100"
    return [flag, "from-the-command-line"], "from-the-command-line"
