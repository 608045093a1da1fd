"""Every console script's parser is its groups' (settings/commands.py): its --help lists each setting with its help,
its config-file keys are its settings' names, no flag is declared outside the settings tree, and the help of a
setting whose values a registry defines names every one of them."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from collections.abc import Iterable

import pytest
import tomllib

from settings.cli import help_text, sections
from settings.commands import COMMANDS, SCRIPT_ALIASES
from settings.config_file import config_keys
from tests.support.paths import REPO

pytestmark = pytest.mark.unit

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
# The add_argument calls allowed outside settings/, each with why it is no setting.
OWN_ARGUMENTS = {
    "clients/client.py": "the prompt: a positional argument, what one call asks (no key, no default)",
}
# Benchmarks and set-up scripts measure or prepare; their flags are their own, not the system's settings.
OWN_FOLDERS = ("scripts/", "tests/", "settings/")


def parser_of(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(SCRIPTS[command].split(":")[0])
    parser: argparse.ArgumentParser = module.build_parser()
    return parser


def test_every_console_script_is_a_command_of_the_tree() -> None:
    assert sorted(SCRIPTS) == sorted([*COMMANDS, *SCRIPT_ALIASES])
    for command in SCRIPTS:
        assert parser_of(command).prog == SCRIPT_ALIASES.get(command, command)


def test_a_script_alias_shares_its_commands_entry() -> None:
    assert SCRIPT_ALIASES == {"vllm-serving": "vllm-serve"}  # article 003's name
    for alias, command in SCRIPT_ALIASES.items():
        assert SCRIPTS[alias] == SCRIPTS[command]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_every_setting_of_the_command_with_its_help(command: str) -> None:
    text = re.sub(r"\s+", "", parser_of(command).format_help())
    found = [e for _, group in sections(COMMANDS[command].parts) for e in group if e.spec.flag]
    assert found
    for e in found:
        assert e.flag in text, e.name
        assert re.sub(r"\s+", "", help_text(e).replace("%%", "%")) in text, e.name


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_config_file_keys_are_the_settings_names(command: str) -> None:
    """Each key is its setting's name, or the command's own spelling of its flag (vllm-serve's `port`)."""
    spelled = COMMANDS[command].spellings
    names = {
        spelled[e.name].flags[0][2:].replace("-", "_") if e.name in spelled else e.name
        for _, group in sections(COMMANDS[command].parts)
        for e in group
        if e.spec.flag
    }
    assert set(config_keys(parser_of(command))) == names


def add_argument_calls(text: str) -> int:
    return sum(
        1
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
    )


def test_no_flag_is_declared_outside_the_settings_tree() -> None:
    found = {
        str(path.relative_to(REPO)): count
        for path in REPO.rglob("*.py")
        if ".venv" not in path.parts
        and not str(path.relative_to(REPO)).startswith(OWN_FOLDERS)
        and (count := add_argument_calls(path.read_text()))
    }
    assert found == dict.fromkeys(OWN_ARGUMENTS, 1)


def test_the_grep_finds_a_call() -> None:
    assert add_argument_calls("p.add_argument('--x')\nq = 1\n") == 1


def test_help_names_every_value_a_registry_defines() -> None:
    from clients.monitor import ALIASES
    from router_node.strategies import STRATEGIES
    from scheduler_node.api.reasoning_parsers import REASONING_PARSERS
    from scheduler_node.api.tool_parsers import TOOL_PARSERS
    from scheduler_node.core.policy import POLICIES

    helps = {e.name: e.spec.help for cmd in COMMANDS.values() for _, group in sections(cmd.parts) for e in group}
    registries: dict[str, Iterable[str]] = {
        "scheduling_policy": POLICIES,
        "tool_call_parser": TOOL_PARSERS,
        "reasoning_parser": REASONING_PARSERS,
        "routing_strategy": STRATEGIES,
        "metric": ALIASES,
    }
    for name, registry in registries.items():
        assert [key for key in registry if not re.search(rf"\b{key}\b", helps[name])] == [], name
