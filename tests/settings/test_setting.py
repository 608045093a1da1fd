"""One setting's declaration (settings/setting.py): its resolved name, kind and default, and the checks each group
runs on itself: the value's type, its choices, its range, each error naming the setting."""

from __future__ import annotations

import pytest

from settings.setting import Bounds, SettingError, entries, setting, walk
from tests.settings.toy import Toy

pytestmark = pytest.mark.unit


def test_an_entry_knows_its_name_kind_and_default() -> None:
    by_field = {e.field: e for e in entries(Toy)}
    assert [e.field for e in entries(Toy)] == ["size", "share", "mode", "names", "on"], "a nested group is no entry"
    assert (by_field["share"].kind, by_field["share"].optional, by_field["share"].items) == (float, True, False)
    assert (by_field["names"].name, by_field["names"].flag, by_field["names"].items) == ("name", "--name", True)
    assert [e.name for e in walk(Toy)] == ["size", "share", "mode", "name", "on", "depth"]
    assert [e.name for e in walk(Toy, skip=("depth", "on"))] == ["size", "share", "mode", "name"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"size": 0}, "size must be in [1, 64], got 0"),
        ({"size": 2.5}, "size must be an integer, got 2.5"),
        ({"size": True}, "size must be an integer, got True"),
        ({"share": 1.0}, "share must be in [0, 1), got 1.0"),
        ({"mode": "c"}, "mode must be one of a, b, got 'c'"),
        ({"names": ["x"]}, "name must be a tuple, got ['x']"),
        ({"names": ("x", 3)}, "name must be a string, got ('x', 3)"),
        ({"on": "yes"}, "on must be true or false, got 'yes'"),
    ],
)
def test_a_value_of_the_wrong_type_or_out_of_range_is_refused_naming_the_setting(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingError) as error:
        Toy(**values)  # type: ignore[arg-type]
    assert str(error.value) == message
    assert error.value.as_flag().startswith("--"), "a command line names the flag instead"


def test_good_values_pass_and_none_only_where_the_type_allows_it() -> None:
    assert Toy(size=64, share=0.0, mode="b", names=("x",), on=False).size == 64
    with pytest.raises(SettingError, match="size must be an integer, got None"):
        Toy(size=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bounds", "words", "inside", "outside"),
    [
        (Bounds(low=1), ">= 1", 1, 0),
        (Bounds(above=0), "> 0", 0.1, 0),
        (Bounds(low=0, below=1), "in [0, 1)", 0, 1),
        (Bounds(above=0, high=1), "in (0, 1]", 1, 0),
        (Bounds(high=4096), "<= 4096", 4096, 4097),
    ],
)
def test_bounds_say_what_they_hold(bounds: Bounds, words: str, inside: float, outside: float) -> None:
    assert bounds.describe() == words
    assert bounds.contains(inside) and not bounds.contains(outside)


def test_a_setting_names_a_known_reader() -> None:
    with pytest.raises(ValueError, match="readers"):
        setting(1, readers="gpu", help="who?")
