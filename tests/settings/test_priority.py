"""Named priority ranges (settings/priority.py): the text and mapping forms, their errors, the flags of the servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from settings.cli import from_args, to_argv
from settings.commands import COMMANDS, command_parser
from settings.config_file import parse_args
from settings.engine import EngineConfig
from settings.priority import PriorityConfig, parse_priority_ranges, priority_ranges_text

pytestmark = pytest.mark.unit


def test_text_and_mapping_forms_are_one_range_table_highest_first() -> None:
    from_text = parse_priority_ranges("batch=20-40, realtime = 80 - 100")
    from_mapping = parse_priority_ranges({"realtime": (80, 100), "batch": [20, 40]})
    assert from_text == from_mapping
    assert [(r.name, r.low, r.high, r.value) for r in from_text] == [("realtime", 80, 100, 90), ("batch", 20, 40, 30)]
    assert priority_ranges_text({"low": (-10, -1)}) == "low=-10--1"
    assert parse_priority_ranges("low=-10--1")[0].value == -6  # the middle, rounded down


@pytest.mark.parametrize(
    ("ranges", "words"),
    [
        ({"realtime": (100, 80)}, "out of order"),
        ({"realtime": (80, 100), "interactive": (60, 80)}, "overlap"),
        ("realtime=80-100,realtime=1-2", "named twice"),
        ("realtime:80-100", "NAME=LOW-HIGH"),
        ("90=80-100", "not a name"),
        ({"realtime": (80,)}, "(low, high)"),
        ({"realtime": ("high", 100)}, "two integers"),
        ({"huge": (0, 2**31)}, "must lie in"),
    ],
)
def test_bad_ranges_are_errors_naming_priority_ranges(ranges: object, words: str) -> None:
    with pytest.raises(ValueError, match="priority_ranges") as err:
        PriorityConfig(priority_ranges=ranges)  # type: ignore[arg-type]
    assert words in str(err.value)


def test_a_name_stands_for_its_ranges_middle() -> None:
    config = PriorityConfig(default_priority=10, priority_ranges="realtime=80-100,batch=20-40")
    assert (config.named("realtime"), config.named("batch"), config.named("bulk")) == (90, 30, None)


def test_the_servers_take_the_flags_and_hand_them_to_their_schedulers() -> None:
    argv = ["--default-priority", "40", "--priority-ranges", "realtime=80-100,batch=20-40"]
    for command in ("vllm-scheduler", "vllm-serve"):
        args = command_parser(command, "").parse_args(argv)
        config = from_args(EngineConfig, args)
        assert config.options.priorities == PriorityConfig(40, "realtime=80-100,batch=20-40"), command
    forwarded = to_argv(COMMANDS["vllm-scheduler"].parts, vars(args), changed_only=True)  # vllm-serve's scheduler
    at = forwarded.index("--default-priority")
    assert forwarded[at : at + 4] == ["--default-priority", "40", "--priority-ranges", "realtime=80-100,batch=20-40"]
    with pytest.raises(SystemExit):
        command_parser("vllm-scheduler", "").parse_args(["--priority-ranges", "realtime=100-80"])


def test_a_config_file_may_write_the_ranges_as_a_mapping(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("default_priority: 40\npriority_ranges:\n  realtime: [80, 100]\n  batch: [20, 40]\n")
    args = parse_args(command_parser("vllm-scheduler", ""), ["--config", str(config)])
    assert from_args(EngineConfig, args).options.priorities == PriorityConfig(40, "realtime=80-100,batch=20-40")
