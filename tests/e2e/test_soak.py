"""scripts/soak.py --smoke: vllm-serve at its defaults under Poisson arrivals for under a minute, its worker killed
(at least) once; every request is accounted for (none lost, none short, none failed) and every block is free at idle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_soak_smoke(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "scripts/soak.py", "--smoke", "--model", str(tiny_llama_dir), "--json",
                          str(out)], cwd=REPO, capture_output=True, text=True, timeout=500)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["kills"] >= 1 and r["sent"] >= 30, r
    assert (r["lost"], r["short"], r["failed"]) == (0, 0, {}), r
    assert r["completed"] + r["cancelled_by_client"] == r["sent"], r
    assert r["idle"]["free_blocks"] == r["idle"]["total_blocks"], r
    assert "| scheduler |" in run.stdout and "| worker |" in run.stdout
