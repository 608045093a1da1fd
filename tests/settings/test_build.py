"""Flat values into a group's tree (settings/build.py): each value in the group that holds it, a setting not given
from its environment override, else its default; an unknown name is a TypeError naming it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from settings.build import build, flat_values, names
from settings.setting import setting
from tests.settings.toy import Toy

pytestmark = pytest.mark.unit


def test_values_land_in_their_groups_and_come_back() -> None:
    toy = build(Toy, {"size": 8, "depth": 5, "name": ["a", "b"]}, env={})
    assert (toy.size, toy.inner.depth, toy.names) == (8, 5, ("a", "b")), "a list of a repeatable setting: a tuple"
    assert build(Toy, flat_values(toy), env={}) == toy
    assert names(Toy) == list(flat_values(toy))


def test_an_unknown_name_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="unknown setting 'sise'"):
        build(Toy, {"sise": 8}, env={})


def test_the_environment_overrides_a_default_but_not_a_given_value() -> None:
    @dataclass(frozen=True, slots=True)
    class Switch:
        """A group with an environment override."""

        fast: bool = setting(True, env="TOY_FAST", readers="worker", help="go fast")
        level: int = setting(1, env="TOY_LEVEL", readers="worker", help="how")

    assert build(Switch, {}, env={"TOY_FAST": "0", "TOY_LEVEL": "3"}) == Switch(False, 3)
    assert build(Switch, {"fast": True}, env={"TOY_FAST": "0"}) == Switch(True, 1)
    with pytest.raises(ValueError, match=r"\$TOY_FAST: expected 1/0"):
        build(Switch, {}, env={"TOY_FAST": "maybe"})


def test_text_is_parsed_where_the_setting_is_not_text() -> None:
    toy = build(Toy, {"size": "16", "on": "off", "share": "0.5"}, env={})
    assert (toy.size, toy.on, toy.share) == (16, False, 0.5)
    with pytest.raises(ValueError):
        build(Toy, {"size": "many"}, env={})
