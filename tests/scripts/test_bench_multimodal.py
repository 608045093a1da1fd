"""scripts/bench_multimodal.py --smoke as CI runs it: every TTFT row (new image, seen image with and without the
prefix cache) and every encoder batch is measured; the figures themselves are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO

pytestmark = pytest.mark.e2e


def test_bench_multimodal_smoke_measures_every_row(tmp_path: Path) -> None:
    out = tmp_path / "mm.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_multimodal.py", "--smoke", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["request"] for r in report["ttft"]] == [
        "new image", "seen image, same prompt", "seen image, new question", "seen image, no prefix caching",
    ]  # fmt: skip
    assert all(r["TTFT ms"] > 0 for r in report["ttft"])
    assert [r["images per call"] for r in report["encoder"]] == [1, 2] and all(
        r["images/s"] > 0 for r in report["encoder"]
    )
    assert "| request | TTFT ms | vs new image |" in run.stdout
