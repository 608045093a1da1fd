"""scripts/bench_spec.py --smoke, as CI runs it: the engines (speculation off, n-gram, and a draft model equal to
the target) run both workloads and report their figures (not asserted: they mean nothing at these sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO

pytestmark = pytest.mark.e2e


def test_bench_spec_smoke_reports_both_engines_on_both_workloads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    run = subprocess.run(
        [
            *(sys.executable, "scripts/bench_spec.py", "--smoke", "--model", str(tiny_llama_dir)),
            *("--draft-model", str(tiny_llama_dir), "--json", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted(r["workload"] for r in rows) == ["copy", "mixed"]
    for row in rows:
        assert row["off"]["tokens"] > 0 and row["identical"], row
        assert "acceptance_length" in row["ngram"] and "acceptance_length" not in row["off"]
        assert row["draft"]["identical"] and row["draft"]["speculated_steps"] > 0, row
