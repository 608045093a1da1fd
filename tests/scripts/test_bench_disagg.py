"""scripts/bench_disagg.py --smoke (CI): colocated and disaggregated rounds over the same two tiny replicas end
without errors, and in the disaggregated mode the decode replica pulled every long prompt's full blocks instead of
computing them (counted tokens, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO

pytestmark = pytest.mark.e2e


def test_bench_disagg_smoke(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "scripts/bench_disagg.py", "--smoke", "--model", str(tiny_llama_dir), "--json", str(out)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["requests"] == 4 and r["errors"] == 0 for r in rows.values()), rows
    assert rows["disaggregated"]["long_cached_tokens"] == 2 * (120 - 1) // 16 * 16, rows
    assert "| disaggregated |" in done.stdout
