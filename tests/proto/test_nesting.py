"""A text nested deeper than Python's recursive parsers go is a ValueError naming the input, not a RecursionError."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from proto.nesting import TooDeep, parse_nested

pytestmark = pytest.mark.unit

DEEP = "[" * 30_000 + "]" * 30_000


@pytest.mark.parametrize("load", [json.loads, yaml.safe_load], ids=["json", "yaml"])
def test_too_deep_is_a_value_error_naming_the_input(load: Callable[[str], Any]) -> None:
    with pytest.raises(TooDeep, match=r"^--some-flag: nested too deeply"):
        parse_nested(load, DEEP, "--some-flag")
    assert parse_nested(load, "[[1]]", "--some-flag") == [[1]]  # what a parser reads, it reads as before
    assert issubclass(TooDeep, ValueError)  # callers that catch the parsers' own ValueErrors catch it too
