"""Sizes and durations with units (settings/units.py), as the articles write them: one parser each, for every
setting that takes one."""

from __future__ import annotations

import re

import pytest

from settings.units import has_byte_unit, parse_duration, parse_gib, parse_size

pytestmark = pytest.mark.unit


def test_sizes_in_decimal_and_binary_units() -> None:
    assert parse_size("16KB") == 16_000 and parse_size("16KiB") == 16_384 and parse_size("16 kib") == 16_384
    assert parse_size("20GB") == 20 * 10**9 and parse_size("4GiB") == 4 * 2**30 and parse_size("512B") == 512
    assert parse_size("1e9") == 10**9 and parse_size("4096") == 4096


def test_gib_settings_take_a_plain_number_or_a_size() -> None:
    assert parse_gib("4") == 4.0 and parse_gib("0.5") == 0.5
    assert parse_gib("512MiB") == 0.5 and parse_gib("20GB") == pytest.approx(18.626, abs=1e-3)


def test_durations_take_ms_s_or_plain_seconds() -> None:
    assert parse_duration("50ms") == pytest.approx(0.05)
    assert parse_duration("0.05s") == pytest.approx(0.05) and parse_duration("0.05") == pytest.approx(0.05)
    assert parse_duration("2min") == 120.0 and parse_duration("1h") == 3600.0


@pytest.mark.parametrize(
    "parse, text, words",
    [
        (parse_size, "16XB", "a size such as 16KB"),
        (parse_size, "-1KB", ">= 0"),
        (parse_gib, "lots", "GiB (a number) or a size"),
        (parse_duration, "50 parsecs", "a duration such as 50ms"),
        (parse_duration, "nan", "finite"),
    ],
)
def test_a_value_without_a_known_unit_is_refused_saying_what_is_expected(parse, text: str, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=re.escape(words)):
        parse(text)


def test_a_byte_unit_is_told_apart_from_a_plain_number() -> None:
    assert has_byte_unit("16KB") and has_byte_unit("512b")
    assert not has_byte_unit("16") and not has_byte_unit(16) and not has_byte_unit("KB")
