"""The benchmark and GPU-check scripts run as CI runs them: quick modes that exercise every code path on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_throughput.py", "--smoke", "--threads", "1", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["engine"], r["dtype"], r["how"].split(",")[0]) for r in report["rows"]}
    for dtype in ("float32", "bfloat16"):
        assert ("minivllm", dtype, "vllm-serve") in rows
        assert ("HF transformers", dtype, "generate") in rows
    assert all(r["tokens"] == report["output_tokens"] and r["tok_s"] > 0 for r in report["rows"])
    assert "| minivllm | bfloat16 | vllm-serve, gRPC |" in run.stdout
