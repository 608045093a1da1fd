"""proto/drop_log.py: every drop is counted, at most one line per interval is logged (the first at once) naming how
many since the last one and the last reason, the reason is turned into text only for a line, and a drop costs less
than the decode that failed."""

from __future__ import annotations

import logging
import timeit

import pytest

from proto.drop_log import MAX_REASON_CHARS, DropLog
from proto.wire import WireError, decode

pytestmark = pytest.mark.unit

LOGGER = logging.getLogger("tests.drop_log")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER.name]


def test_the_first_drop_is_logged_at_once_then_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    drops = DropLog("workers", LOGGER, interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, LOGGER.name):
        drops.drop("a malformed message (%d bytes)", 3)
        assert len(lines(caplog)) == 1 and "workers: dropped 1 message(s)" in lines(caplog)[0]
        for i in range(5000):
            drops.drop("a malformed message (%d bytes)", i)
            clock.now += 0.001  # 5 s in all: within the interval
        assert len(lines(caplog)) == 1, "nothing more within the interval"
        clock.now += 5.0
        drops.drop("the last one (%d bytes)", 7)
    assert len(lines(caplog)) == 2
    assert "dropped 5001 message(s)" in lines(caplog)[1] and "(5002 in all" in lines(caplog)[1]
    assert lines(caplog)[1].endswith("the last: the last one (7 bytes)")
    assert drops.total == 5002


def test_flush_reports_what_no_line_has_yet(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    drops = DropLog("kv_transfer", LOGGER, clock=clock)
    with caplog.at_level(logging.WARNING, LOGGER.name):
        drops.flush()
        assert lines(caplog) == [], "nothing dropped: nothing to say"
        drops.drop(WireError("one"))
        drops.drop(WireError("two"))
        drops.flush()
        drops.flush()
    assert len(lines(caplog)) == 2 and "dropped 1 message(s)" in lines(caplog)[1]
    assert lines(caplog)[1].endswith("the last: two")


def test_the_reason_is_formatted_only_for_a_line_and_kept_short(caplog: pytest.LogCaptureFixture) -> None:
    formatted: list[int] = []

    class Reason:
        def __str__(self) -> str:
            formatted.append(1)
            return "x" * 10_000  # a reason quoting a hostile message

    drops = DropLog("workers", LOGGER, clock=Clock())
    with caplog.at_level(logging.WARNING, LOGGER.name):
        for _ in range(1000):
            drops.drop(Reason())
        drops.drop("%d of %d", "not a number")  # a format that does not fit its arguments: still a line, no raise
        drops.flush()
    assert len(formatted) == 1, "the 999 drops between two lines were not formatted"
    assert len(lines(caplog)[0]) < MAX_REASON_CHARS + 200
    assert "not a number" in lines(caplog)[1]


def test_a_drop_costs_less_than_decoding_the_malformed_message_it_counts() -> None:
    """The hot path of a flood: decoding a malformed frame and counting it. The counting must not dominate."""
    drops = DropLog("workers", LOGGER, interval_s=3600.0)
    drops.drop("first")  # the one line, out of the way
    garbage = b"\x92\x0f\x93\x03\xc1"  # the right version, then a byte msgpack never uses

    def decode_it() -> None:
        try:
            decode(garbage)
        except WireError:
            pass

    error = WireError("x")
    decoding = min(timeit.repeat(decode_it, number=2000, repeat=5))
    counting = min(timeit.repeat(lambda: drops.drop("a malformed message (%d bytes): %s", 5, error), number=2000,
                                 repeat=5))  # fmt: skip
    assert counting < decoding, f"2000 drops took {counting:.4f} s, 2000 failed decodes {decoding:.4f} s"
