"""Text from outside parsed by a recursive parser (json.loads, yaml.safe_load): a flag's JSON, a --config file, a
client's tool-call arguments. Both parsers recurse once per level of nesting, so a text nested some thousands deep
ran Python's stack out: a RecursionError traceback and exit 1 at start (`--speculative-config '[[[...]]]'`), or a
500 at a door, where a one-line refusal naming the input was due."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TooDeep(ValueError):
    """A text nested deeper than the parser's recursion allows."""


def parse_nested(load: Callable[[str], T], text: str, what: str) -> T:
    """`load(text)`; TooDeep (a ValueError, as the parsers' own errors are) naming `what` in place of the
    RecursionError a deeply nested text raises."""
    try:
        return load(text)
    except RecursionError:
        raise TooDeep(f"{what}: nested too deeply (objects and arrays inside one another)") from None
