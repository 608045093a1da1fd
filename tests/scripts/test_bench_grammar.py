"""scripts/bench_grammar.py --smoke runs both grammar engines over the same token walks and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.e2e


def test_bench_grammar_smoke(smollm2_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "scripts/bench_grammar.py", "--smoke", "--model", str(smollm2_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split()[0] for line in out.stdout.splitlines()]
    assert "llguidance" in rows and "xgrammar" in rows, out.stdout
