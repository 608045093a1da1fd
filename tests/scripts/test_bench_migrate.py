"""scripts/bench_migrate.py --smoke (CI): a rolling restart of one of two replicas behind vllm-router, under load,
with migration: every stream completes, none is cut, the drained replica exits 0. Counts, not timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two replicas, a router and a restart: minutes on 2 loaded cores


def test_a_rolling_restart_with_migration_cuts_no_stream(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "scripts/bench_migrate.py", "--smoke", "--model", str(tiny_llama_dir), "--json", str(out)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    plain, migrated = json.loads(out.read_text())
    assert plain["exit_codes"] == migrated["exit_codes"] == [0, 0], (plain, migrated)
    assert plain["completed"] + plain["cut"] == plain["streams"] == 8 and plain["migrated"] == 0, plain
    assert (migrated["completed"], migrated["cut"]) == (8, 0) and migrated["migrated"] >= 1, migrated
    assert "| drain --migrate, then stop | 8/8 | 0 |" in done.stdout
