"""scripts/bench_kv_routing.py --smoke (CI): on a multi-tenant workload whose shared preamble is longer than the
`prefix` strategy's window, `kv` routing (on the replicas' KV events) finds more of the prompts cached than
`prefix` and `round_robin`. Hit rates are counted tokens, not timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO

pytestmark = pytest.mark.e2e


def test_kv_routing_finds_more_of_the_prompts_cached(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "scripts/bench_kv_routing.py", "--smoke", "--model", str(tiny_llama_dir), "--json",
            str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["kv"]["hit_rate"] >= max(rows["prefix"]["hit_rate"], rows["round_robin"]["hit_rate"]) + 0.05, rows
    assert all(r["requests"] == sum(r["per_replica"]) == 96 for r in rows.values()), rows
    assert rows["kv"]["decisions"].get("overlap", 0) > rows["kv"]["decisions"].get("least", 0), rows
    assert "| kv |" in done.stdout
