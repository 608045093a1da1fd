"""What the doors accept as a request's priority: the default, and named ranges (`realtime=80-100,batch=20-40`).

A request names its priority by number (higher runs first) or by a range's name (`priority="realtime"`, the
`X-Priority: realtime` header), which stands for the middle of its range (realtime 80-100 is 90), so a number
inside the range can still rank a request above or below the named ones. The scheduling policy
(`--scheduling-policy priority`, scheduler_node/core/policy.py) does the ordering; these settings only say what a
name means and what a request that says nothing gets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from settings.setting import check, setting

DEFAULT_PRIORITY = 50
INT32 = (-(2**31), 2**31 - 1)  # a priority is an int32 on every door
_BOUNDS = re.compile(r"\s*(-?\d+)\s*-\s*(-?\d+)\s*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # never a number, so `X-Priority: 90` stays a number


@dataclass(frozen=True, slots=True)
class PriorityRange:
    name: str
    low: int
    high: int

    @property
    def value(self) -> int:
        """The priority a request naming this range gets: the range's middle (rounded down)."""
        return (self.low + self.high) // 2

    def __str__(self) -> str:
        return f"{self.name}={self.low}-{self.high}"


def parse_priority_ranges(value: str | Mapping[str, Sequence[int]]) -> tuple[PriorityRange, ...]:
    """`realtime=80-100,batch=20-40` or `{"realtime": (80, 100), "batch": (20, 40)}` as ranges, highest first.
    ValueError naming priority_ranges: a bad name or number, a range whose low end is above its high end, two
    ranges that overlap or share a name."""
    pairs = _pairs(value)
    ranges = [_range(name, bounds) for name, bounds in pairs]
    names = [r.name for r in ranges]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"priority_ranges: {name!r} is named twice")
    ranges.sort(key=lambda r: r.low, reverse=True)
    for upper, lower in zip(ranges, ranges[1:]):
        if lower.high >= upper.low:
            raise ValueError(f"priority_ranges: {lower} and {upper} overlap; a priority must name one range at most")
    return tuple(ranges)


def priority_ranges_text(value: str | Mapping[str, Sequence[int]]) -> str:
    """The setting's text form, checked: what a command line forwards and a config file may write as a mapping."""
    return ",".join(str(r) for r in parse_priority_ranges(value))


def _pairs(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [(str(name), bounds) for name, bounds in value.items()]
    if not isinstance(value, str):
        raise ValueError(f"priority_ranges: must be text NAME=LOW-HIGH,... or a mapping, got {type(value).__name__}")
    pairs = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, bounds = item.partition("=")
        found = _BOUNDS.fullmatch(bounds)
        if not sep or found is None:
            raise ValueError(f"priority_ranges: {item!r} is not NAME=LOW-HIGH (realtime=80-100)")
        pairs.append((name.strip(), found.groups()))
    return pairs


def _range(name: str, bounds: Any) -> PriorityRange:
    if not _NAME.fullmatch(name):
        raise ValueError(f"priority_ranges: {name!r} is not a name (a letter first, then letters, digits, _ . -)")
    if isinstance(bounds, (str, bytes)) or not isinstance(bounds, Sequence) or len(bounds) != 2:
        raise ValueError(f"priority_ranges: {name!r} must be (low, high), got {bounds!r}")
    try:
        low, high = (int(b) for b in bounds)
    except (TypeError, ValueError):
        raise ValueError(f"priority_ranges: {name!r} must be two integers, got {bounds!r}") from None
    if low > high:
        raise ValueError(f"priority_ranges: {name!r} is out of order: {low} is above {high}")
    if low < INT32[0] or high > INT32[1]:
        raise ValueError(f"priority_ranges: {name!r} must lie in [{INT32[0]}, {INT32[1]}]")
    return PriorityRange(name, low, high)


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    """A request's priority when it gives none, and the names it may give instead of a number."""

    default_priority: int = setting(
        DEFAULT_PRIORITY,
        low=INT32[0],
        high=INT32[1],
        readers="scheduler",
        help="the priority of a request that names none (higher runs first under --scheduling-policy priority, "
        "dynamic or hybrid)",
    )
    priority_ranges: str = setting(
        "",
        parse=priority_ranges_text,
        metavar="NAME=LOW-HIGH,...",
        readers="scheduler",
        help="named priority ranges a request may give instead of a number (realtime=80-100,batch=20-40): the "
        "request's priority field or X-Priority header then says realtime, which stands for its range's middle",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority_ranges", priority_ranges_text(self.priority_ranges))
        check(self)

    @property
    def ranges(self) -> tuple[PriorityRange, ...]:
        return parse_priority_ranges(self.priority_ranges)

    def named(self, name: str) -> int | None:
        """The priority a range's name stands for; None when no range has this name."""
        return next((r.value for r in self.ranges if r.name == name), None)
