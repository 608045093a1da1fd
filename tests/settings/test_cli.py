"""Command lines from groups (settings/cli.py): a flag per setting with its type, choices and `--no-` form, the
environment override as the default, a group built back from the flags (errors naming the flag), the flags that
hand settings on to a child, and a setting defined twice in one command refused."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from settings.cli import DuplicateSetting, Part, add_settings, from_args, help_text, to_argv
from settings.setting import entries, setting
from tests.settings.toy import Inner, Toy

pytestmark = pytest.mark.unit


def parser(*parts: Part, defaults: dict[str, object] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    add_settings(p, parts or (Part(Toy),), defaults)
    return p


def test_each_setting_is_a_flag_with_its_type_choices_and_no_form() -> None:
    args = parser().parse_args(["--size", "8", "--mode", "b", "--name", "x", "--name", "y", "--no-on", "--depth", "0"])
    assert (args.size, args.mode, args.name, args.on, args.depth) == (8, "b", ["x", "y"], False, 0)
    assert from_args(Toy, args) == Toy(size=8, mode="b", names=("x", "y"), on=False, inner=Inner(0))
    with pytest.raises(SystemExit):
        parser().parse_args(["--mode", "c"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--size", "many"])


def test_a_value_out_of_range_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^--size must be in \[1, 64\], got 0$"):
        from_args(Toy, parser().parse_args(["--size", "0"]))


def test_a_command_sets_its_own_defaults_and_takes_part_of_a_group() -> None:
    args = parser(Part(Toy, only=("size", "depth")), defaults={"size": 32}).parse_args([])
    assert vars(args) == {"size": 32, "depth": 2}
    assert "size" not in vars(parser(Part(Toy, skip=("size",))).parse_args([]))


def test_the_environment_override_is_the_default_read_at_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclass(frozen=True, slots=True)
    class Switch:
        """A switch with an environment override."""

        fast: bool = setting(True, env="TOY_FAST", readers="worker", help="go fast")

    monkeypatch.setenv("TOY_FAST", "0")
    assert parser(Part(Switch)).parse_args([]).fast is False
    assert parser(Part(Switch)).parse_args(["--fast"]).fast is True, "the flag wins"
    assert help_text(entries(Switch)[0]) == "go fast [env $TOY_FAST]"
    monkeypatch.setenv("TOY_FAST", "maybe")
    with pytest.raises(SystemExit):
        parser(Part(Switch))


@dataclass(frozen=True, slots=True)
class Clash:
    """A group whose setting takes a name Toy has."""

    sized: int = setting(1, name="size", readers="worker", help="another size")


@dataclass(frozen=True, slots=True)
class AliasClash:
    """A group whose alias is another group's flag."""

    count: int = setting(1, aliases=("depth",), readers="worker", help="another depth")


@pytest.mark.parametrize("other", [Clash, AliasClash])
def test_a_setting_defined_twice_in_one_command_is_refused(other: type) -> None:
    with pytest.raises(DuplicateSetting, match="defined twice"):
        parser(Part(Toy), Part(other))
    parser(Part(Toy), Part(Toy, only=("size",)))  # one group twice: one definition, no clash


def test_settings_handed_on_parse_back() -> None:
    toy = Toy(size=9, share=0.5, names=("a b",), on=False)
    values = {"size": 9, "share": 0.5, "name": ["a b"], "on": False, "mode": "a", "depth": 2}
    argv = to_argv([Part(Toy)], values, changed_only=True)
    assert argv == ["--size", "9", "--share", "0.5", "--name", "a b", "--no-on"], "only what differs from defaults"
    assert from_args(Toy, parser().parse_args(argv)) == toy
    assert "--mode" in to_argv([Part(Toy)], values), "all of them, where asked"


def test_a_percent_in_help_does_not_break_argparse() -> None:
    @dataclass(frozen=True, slots=True)
    class Percent:
        """A help with a percent sign."""

        share: float = setting(0.5, readers="worker", help="50 % of it")

    assert "50 % of it" in parser(Part(Percent)).format_help()
