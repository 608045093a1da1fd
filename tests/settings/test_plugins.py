"""`module:Name` extension points: loaded by one function, refused with an error naming the kind and the spec."""

from __future__ import annotations

import collections

import pytest

from settings.plugins import load_named, load_subclass

pytestmark = pytest.mark.unit


def test_a_named_object_and_a_subclass_load() -> None:
    assert load_named("collections:OrderedDict", "thing") is collections.OrderedDict
    assert load_subclass("collections:OrderedDict", dict, "mapping") is collections.OrderedDict


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module:X", "cannot load widget 'no_such_module:X'"),
        ("collections:Missing", "cannot load widget 'collections:Missing'"),
        (":X", "cannot load widget ':X'"),
        ("collections:deque", "widget 'collections:deque' is not a subclass of builtins.dict"),
        ("collections:namedtuple", "widget 'collections:namedtuple' is not a subclass of builtins.dict"),
    ],
)
def test_what_cannot_be_loaded_is_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_subclass(spec, dict, "widget")
