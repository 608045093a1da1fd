"""The liveness pipe: a worker's beats reach its launcher, READY switches the bound from the join timeout to the
heartbeat timeout, silence past the bound is a stall, and a worker whose launcher went away stops beating."""

from __future__ import annotations

import os
import time

import pytest

from proto.liveness import LIVENESS_FD_ENV, Beats, Pulse

pytestmark = pytest.mark.unit


def worker_of(pulse: Pulse, monkeypatch: pytest.MonkeyPatch) -> Beats:
    """A worker's side on this process's copy of the write end (its thread beats at once, then every second)."""
    monkeypatch.setenv(LIVENESS_FD_ENV, str(pulse.write_fd))
    return Beats()


def test_silence_past_the_join_bound_is_a_stall_and_a_beat_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pulse = Pulse(join_timeout=5.0, heartbeat_timeout=1.0)
    pulse.last_beat = time.monotonic() - 6.0  # six silent seconds while joining
    assert pulse.stalled_for() > 5.0
    beats = worker_of(pulse, monkeypatch)
    deadline = time.monotonic() + 10
    while pulse.stalled_for() and time.monotonic() < deadline:
        time.sleep(0.01)  # the beat thread's first write
    assert pulse.stalled_for() == 0.0 and not pulse.ready
    beats.stop()
    pulse.close()


def test_ready_applies_the_heartbeat_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    pulse = Pulse(join_timeout=60.0, heartbeat_timeout=1.0)
    beats = worker_of(pulse, monkeypatch)
    beats.ready()
    assert pulse.stalled_for() == 0.0 and pulse.ready
    beats.stop()
    pulse.last_beat = time.monotonic() - 2.0  # within the join bound, past the heartbeat one
    _drain(pulse)  # beats the thread wrote before it stopped: only silence is left
    assert pulse.stalled_for() > 1.0
    pulse.close()


def test_a_worker_whose_launcher_is_gone_stops_beating(monkeypatch: pytest.MonkeyPatch) -> None:
    pulse = Pulse(join_timeout=60.0, heartbeat_timeout=1.0)
    beats = worker_of(pulse, monkeypatch)
    beats.stop()
    os.close(pulse.read_fd)  # the launcher died
    assert beats._write() is False


def test_without_the_variable_a_worker_beats_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LIVENESS_FD_ENV, raising=False)
    assert Beats()._write() is False


def _drain(pulse: Pulse) -> None:
    try:
        while os.read(pulse.read_fd, 4096):
            pass
    except BlockingIOError:
        pass
