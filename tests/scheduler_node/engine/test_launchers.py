"""The local launcher (vllm-serve's, a TP/PP LLM's) with stand-in worker processes: a worker whose liveness beats
stop (SIGSTOP) past the heartbeat timeout is killed with its process group and started again; one that exits for
bad flags is not restarted forever."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from scheduler_node.engine.launchers import LocalLauncher
from settings.worker import EXIT_BAD_FLAGS
from tests.support.ops import alive, wait_for

pytestmark = pytest.mark.e2e

# The first one joins, says it is ready, starts a child in its process group, and stops itself; the others beat.
STALLING_WORKER = """
import os, signal, subprocess, sys, time
from proto.liveness import Beats
beats = Beats()
beats.ready()
marker = sys.argv[1]
if not os.path.exists(marker):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(marker, "w").write(str(child.pid))
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(600)
"""


def _launcher(argv: list[str], heartbeat_timeout: float = 600.0) -> LocalLauncher:
    launcher = LocalLauncher(1, join_timeout=600.0, heartbeat_timeout=heartbeat_timeout)
    launcher.argv = argv
    proc, pulse = launcher._spawn()
    launcher.procs, launcher.pulses = [proc], [pulse]
    return launcher


def test_a_stalled_worker_and_its_process_group_are_killed_and_it_is_started_again(tmp_path: Path) -> None:
    marker = tmp_path / "stalled-child"
    launcher = _launcher([sys.executable, "-c", STALLING_WORKER, str(marker)], heartbeat_timeout=1.0)
    try:
        first = launcher.procs[0]
        wait_for(lambda: marker.exists() and marker.read_text(), 60, "the first worker stalled")
        child = int(marker.read_text())
        stopped = time.monotonic()

        def replaced() -> bool:
            launcher.keep_alive()
            return launcher.procs[0] is not first

        wait_for(replaced, 60, "a replacement started", interval=0.1)
        assert time.monotonic() - stopped >= 0.5, "killed before its heartbeat timeout"
        assert first.returncode == -9
        wait_for(lambda: not alive(child), 10, "its process group went with it")
        assert launcher.procs[0].poll() is None and not launcher.gave_up
    finally:
        launcher.stop(0.0)


def test_a_worker_that_exits_for_bad_flags_is_not_restarted() -> None:
    launcher = _launcher([sys.executable, "-c", f"import sys; sys.exit({EXIT_BAD_FLAGS})"])
    try:
        first = launcher.procs[0]

        def gave_up() -> bool:
            launcher.keep_alive()
            return bool(launcher.gave_up)

        wait_for(gave_up, 60, "the launcher gives up", interval=0.1)
        launcher.keep_alive()
        assert launcher.procs[0] is first, "restarted"
        assert f"exited with {EXIT_BAD_FLAGS}: bad flags" in launcher.gave_up
    finally:
        launcher.stop(0.0)
