"""scripts/bench_router.py --smoke (CI): the prefix strategy's prefix-cache hit rate beats round robin's and nears
the single replica's on a shared-prefix workload. Hit rates are counted tokens, not timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.cluster import REPO

pytestmark = pytest.mark.e2e


def test_prefix_routing_keeps_the_hit_rate_of_one_cache(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "scripts/bench_router.py", "--smoke", "--model", str(tiny_llama_dir), "--json", str(out)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {(r["setup"], r["strategy"]): r for r in json.loads(out.read_text())}
    single = rows["1 replica, 2x KV", "round_robin"]["hit_rate"]
    round_robin = rows["2 replicas", "round_robin"]["hit_rate"]
    prefix = rows["2 replicas", "prefix, load factor 1.5"]
    assert prefix["hit_rate"] >= round_robin + 0.1, rows
    assert prefix["hit_rate"] >= 0.65 * single, rows
    assert sum(prefix["per_replica"]) == prefix["requests"] == 128 and min(prefix["per_replica"]) > 0
    assert "| 2 replicas | prefix, load factor 1.5 |" in done.stdout
