"""Quantities written with units, as the articles and operators write them: byte sizes (`16KB`, `20GB`, `4GiB`) and
durations (`50ms`, `0.05s`). Every setting that takes one parses it here, so `20GB` means the same to each."""

from __future__ import annotations

import math

# Longest suffix first: `kib` before `b`, `ms` before `s`. KB, MB, GB are decimal (10^3...); KiB, MiB, GiB binary.
BYTE_UNITS = {
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "b": 1,
}
DURATION_UNITS = {"ms": 1e-3, "us": 1e-6, "min": 60.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def _number(text: str, what: str, original: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected {what}, got {original!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"expected {what} (a finite number >= 0), got {original!r}")
    return value


def _split(text: str, units: dict[str, float] | dict[str, int]) -> tuple[str, float | int | None]:
    lowered = str(text).strip().lower().replace(" ", "")
    for unit in sorted(units, key=len, reverse=True):
        if lowered.endswith(unit) and lowered[: -len(unit)]:
            return lowered[: -len(unit)], units[unit]
    return lowered, None


def has_byte_unit(text: object) -> bool:
    """True for a string such as '16KB' or '512B' (not a plain number, nor a unit alone)."""
    if not isinstance(text, str):
        return False
    number, factor = _split(text, BYTE_UNITS)
    try:
        float(number)
    except ValueError:
        return False
    return factor is not None


def parse_size(text: str) -> int:
    """Bytes: '16KB' (10^3), '4GiB' (2^30), '1e9' or a plain byte count."""
    number, factor = _split(text, BYTE_UNITS)
    words = "a size such as 16KB, 4GiB or a byte count"
    return int(_number(number, words, str(text)) * (factor or 1))


def parse_gib(text: str) -> float:
    """GiB: a plain number is GiB ('4' or '0.5'); with a unit, the size in GiB ('20GB' is 18.6, '512MiB' 0.5)."""
    number, factor = _split(text, BYTE_UNITS)
    words = "GiB (a number) or a size such as 20GB or 512MiB"
    value = _number(number, words, str(text))
    return value if factor is None else value * factor / 2**30


def parse_duration(text: str) -> float:
    """Seconds: a plain number is seconds ('0.05'); with a unit: '50ms', '0.05s', '2min', '1h'."""
    number, factor = _split(text, DURATION_UNITS)
    value = _number(number, "seconds, or a duration such as 50ms or 0.05s", str(text))
    return value * (factor or 1.0)
