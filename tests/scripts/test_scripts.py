"""The benchmark and GPU-check scripts run as CI runs them: quick modes that exercise every code path on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.e2e


def _run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    run = _run_script("scripts/bench_throughput.py", "--smoke", "--threads", "1", "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["engine"], r["dtype"], r["how"].split(",")[0]) for r in report["rows"]}
    for dtype in ("float32", "bfloat16"):
        assert ("minivllm", dtype, "vllm-serve") in rows
        assert ("minivllm", dtype, "in-process") in rows
        assert ("HF transformers", dtype, "generate") in rows
    assert all(r["tokens"] == report["output_tokens"] and r["tok_s"] > 0 for r in report["rows"])
    assert "| minivllm | bfloat16 | vllm-serve, gRPC |" in run.stdout


def _gpu_check(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "WHL": str(tmp_path / "no-wheels")}
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--out", str(tmp_path / "out"), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gpu_check_dry_run_imports_every_part(tmp_path: Path) -> None:
    run = _gpu_check(tmp_path, "--dry-run", "--skip", "tp")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    assert "kernels.triton_attention" in report["imports"] and "zmq" in report["imports"]
    assert (Path(report["model"]) / "config.json").is_file(), "the default model converts without a hub"
    assert report["parts"] == ["kernels", "engine", "quant", "decode", "lora", "kv_ipc"]
    quant = report["quant_dry_run"]  # quantized weights: the layers' CPU kernels vs float64, each format's engine
    assert quant["kernels"] and all(c["ok"] for c in quant["kernels"]), quant["kernels"]
    engines = {row["format"]: row for row in quant["engine"]}
    assert list(engines) == ["none", "int8", "fp8", "awq"] and not any("error" in row for row in engines.values())
    assert all(row["graphs same as eager"] == "2/2" and row["decode tok/s, 2 seqs"] > 0 for row in engines.values())
    rows = report["decode_dry_run"]["rows"]  # the decode part's code, at a tiny size on the CPU
    assert [r["seqs"] for r in rows] == [2, 4]
    assert all(r["decode tok/s"] > 0 and r["HF decode tok/s"] > 0 and r["vs HF"] > 0 for r in rows)
    assert all(r["decode tok/s, not overlapped"] > 0 for r in rows), "overlapping's A/B runs too"
    lora = report["lora_dry_run"]  # LoRA in decode graphs: its code on the CPU, where nothing is captured
    assert lora["same as eager"] == "4/4" and lora["mixed decode tok/s"] > 0 and lora["base decode tok/s"] > 0
    assert lora["graphs with LoRA"] is False and lora["graph steps with adapter rows"] == 0
    kv = report["kv_ipc_dry_run"]  # two processes, the staging path through /dev/shm here (CUDA IPC on a GPU)
    assert kv["bytes identical"] is True and kv["staging kind"] == "shm"
    assert (kv["staged pulls"], kv["framed pulls"]) == (1, 1) and kv["staged"]["GB/s"] > 0 and kv["tcp"]["GB/s"] > 0


def test_gpu_check_rejects_an_unknown_part(tmp_path: Path) -> None:
    run = _gpu_check(tmp_path, "--dry-run", "--skip", "kernels,bogus")
    assert run.returncode == 2
    assert "--skip: unknown part(s) bogus" in run.stderr


def test_bench_cpu_dtypes_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cpu_dtypes.json"
    run = _run_script("scripts/bench_cpu_dtypes.py", "--smoke", "--threads", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["rows"] for row in report["table"]] == [1, 16]
    dtypes = ("float32", "bfloat16")
    assert all(row[d]["layer_ms"] > 0 and row[d]["head_ms"] > 0 for row in report["table"] for d in dtypes)
    assert all(row["float32_ms"] > 0 and row["bfloat16_ms"] > 0 for row in report["attention"])


@pytest.mark.slow
def test_bench_kv_quant_smoke(tmp_path: Path) -> None:
    out = tmp_path / "kv_quant.json"
    run = _run_script("scripts/bench_kv_quant.py", "--smoke", "--threads", "1", "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    capacity = {r["cache"]: r for r in report["capacity"]}
    assert capacity["int8"]["blocks_per_gib"] > capacity["bfloat16"]["blocks_per_gib"] * 1.8
    float32 = next(r for r in report["fidelity"] if r["cache"] == "float32" and r["model"] == "tiny llama")
    assert float32["rate"] == 1.0  # the yardstick: a full-precision cache agrees everywhere
    caches = {(r["cache"], r["scales"]) for r in report["granularity"] if r["model"] == "all models"}
    assert ("int8", "per block, re-quantized") in caches and ("fp8_e4m3", "per token") in caches
    assert all(ms > 0 for row in report["decode"] for ms in row["ms"].values())
    assert "| tiny llama | int8 |" in run.stdout


def test_bench_scheduler_smoke(tmp_path: Path, smollm2_dir: Path) -> None:
    out = tmp_path / "scheduler.json"
    args = ("--smoke", "--repeat", "2", "--model", str(smollm2_dir), "--json", str(out))
    run = _run_script("scripts/bench_scheduler.py", *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    cells = [(r["policy"], r["seqs"], r["context"]) for r in report["rows"]]
    assert sorted(cells) == sorted((p, n, c) for p in ("fcfs", "priority") for n, c in ((8, 40), (32, 40), (8, 100)))
    for r in report["rows"]:
        assert r["steps"] == 10 and r["sum_ms"] > 0 and r["output_ms"] > 0 and r["runs"] == 2
        assert r["plan_bytes_per_seq"] <= 24, r  # the compact plan: handle, computed tokens, scheduled tokens
    assert report["admission"]["requests"] == 16
    assert "| fcfs | 32 | 40 |" in run.stdout and "| new requests |" in run.stdout


def test_bench_glue_smoke() -> None:
    run = _run_script("scripts/bench_glue.py", "--smoke")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["float32", "bfloat16"]
    assert all(row[-1] == "True" for row in rows), run.stdout  # the fused glue gives torch's results


def test_bench_wire_smoke() -> None:
    run = _run_script("scripts/bench_wire.py", "--smoke")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in run.stdout.splitlines()[2:]}
    assert set(rows) == {"msgspec Structs, integer handles", "hand-written, uuid ids", "hand-written, short ids"}
    assert float(rows["msgspec Structs, integer handles"][7]) <= 24


def test_bench_kv_precision_smoke(tmp_path: Path, tiny_llama_dir: Path) -> None:
    out = tmp_path / "kv_precision.json"
    argv = ["scripts/bench_kv_precision.py", "--smoke", "--model", str(tiny_llama_dir), "--threads", "1"]
    run = _run_script(*argv, "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    off, on = rows["capacity: mode off"], rows["capacity: mode on"]
    assert off["compact_blocks"] == 0 and on["compact_blocks"] > 0
    # the same bytes: the mode gives half to compact blocks, which int8 makes ~3.8x smaller than float32 ones
    assert on["full_blocks"] + on["compact_blocks"] > off["full_blocks"] * 2
    assert on["most_running"] > off["most_running"], "the mode must hold more requests at once"
    assert all(r["output_tokens"] == r["requests"] * 8 for r in report["rows"]), "every request ran to the end"
    assert all(
        rows[f"split: {x}"]["most_running"] == rows[f"split: {x}"]["requests"]
        for x in ("all full", "all compact", "half and half")
    )
    assert "| capacity: mode on |" in run.stdout and "requests held at once" in run.stdout
