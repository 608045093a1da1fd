"""The GPU-minded benchmarks' --smoke modes, run as CI runs them (on CPU): every part a CPU reaches runs at tiny
sizes, so a call that drifts from the API it uses fails here instead of on a GPU machine. The figures are not
asserted (they mean nothing at these sizes); the rows that prove each part ran, and agreed, are."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernels import cpu_gemm, cpu_gemm_portable
from minivllm.cluster import REPO

pytestmark = pytest.mark.e2e


def _smoke(script: str, model: Path | None, out: Path, *flags: str) -> tuple[str, Any]:
    """Run `scripts/<script> --smoke` on `model` (None: a script that loads none) with no GPU visible; its stdout
    and its JSON report (as written)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    model_flags = [] if model is None else ["--model", str(model)]
    run = subprocess.run(
        [sys.executable, f"scripts/{script}", "--smoke", *model_flags, "--json", str(out), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_bench_kernels_smoke_runs_the_kernel_checks_and_every_cpu_backend(tiny_llama_dir: Path, tmp_path: Path) -> None:
    stdout, report = _smoke("bench_kernels.py", tiny_llama_dir, tmp_path / "kernels.json")
    assert report["device"] == "cpu"
    assert "decode/prefill speed runs and the sweep: they time CUDA events" in report["skipped"]
    has_triton = importlib.util.find_spec("triton") is not None
    want = ["torch", "native"] + (["triton (interpreter)"] if has_triton else [])
    engine = report["engine"]
    assert [row["backend"] for row in engine] == want
    for row in engine:  # fp32 on one machine: every backend decodes the same greedy tokens as the reference
        assert row["same as torch"] == "2/2", row
        assert row["total s"] > 0 and row["first-token s"] > 0, row
    assert "## engine decode on cpu, 2 x (8 prompt + 4 output) tokens, float32" in stdout
    if has_triton:  # Triton's interpreter: every kernel at one small shape, fp32 and fp16 (bf16 is GPU-only)
        checks = report["correctness"]
        kernels = ["decode[seg=1]", "decode[seg=4]", "decode[seg=None]", "prefill", "write_kv"]
        assert sorted((r["kernel"], r["dtype"]) for r in checks) == sorted(
            (k, d) for k in kernels for d in ("fp16", "fp32")
        )
        assert all(r["ok"] for r in checks), checks
        assert "## correctness vs torch reference (cpu)" in stdout


@pytest.mark.slow
def test_bench_parallel_smoke_serves_every_token_with_tp1_and_tp2(tiny_llama_dir: Path, tmp_path: Path) -> None:
    stdout, report = _smoke("bench_parallel.py", tiny_llama_dir, tmp_path / "parallel.json")
    rows = report["layouts"]
    assert [(r["tp"], r["pp"], r["threads_per_worker"]) for r in rows] == [(1, 1, 1), (2, 1, 1)]
    assert report["requests"] == 4
    tokens = {r["tokens"] for r in rows}  # 4 requests of 4-8 tokens each, the same workload in every world
    assert len(tokens) == 1 and 16 <= tokens.pop() <= 32, rows
    assert all(r["tok_s"] > 0 for r in rows)
    assert "| TP1 x PP1 | 1 x 1 |" in stdout and "| TP2 x PP1 | 2 x 1 |" in stdout


@pytest.mark.slow
def test_bench_priority_smoke_runs_every_row_back_to_back(tiny_llama_dir: Path, tmp_path: Path) -> None:
    stdout, rows = _smoke("bench_priority.py", tiny_llama_dir, tmp_path / "priority.json")
    assert [(r["policy"], r["loaded"]) for r in rows] == [("priority", False), ("priority", True), ("fcfs", True)]
    for r in rows:
        assert r["rt_ttft_p50"] > 0 and r["rt_e2e_p99"] >= r["rt_ttft_p99"] > 0
        assert r["batch_failed"] == 0
    assert all(r["batch_done"] > 0 for r in rows if r["loaded"]), "the batch load ran"
    assert "| priority | batch |" in stdout and "| fcfs | batch |" in stdout


def test_bench_overhead_smoke_measures_both_paths_per_component(smollm2_dir: Path, tmp_path: Path) -> None:
    stdout, report = _smoke("bench_overhead.py", smollm2_dir, tmp_path / "overhead.json")
    rows = {r["path"]: r for r in report["rows"]}
    assert set(rows) == {"in-process", "worker process"}
    for r in rows.values():
        assert r["seqs"] == 8 and r["steps"] == 10, r
        assert r["engine_ms"] > 0 and r["worker_ms"] > 0 and r["prepare_ms"] > 0 and r["sampler_ms"] > 0, r
        # the parts are of one thread's clock: they never add up to more than the whole
        assert r["engine_ms"] >= r["schedule_update_ms"] + r["wire_ms"] > 0, r
        assert r["worker_ms"] >= r["prepare_ms"] + r["sampler_ms"], r
        assert r["output_thread_ms"] > 0, r  # the output path runs on its own thread
    assert rows["worker process"]["worker_process_ms"] >= rows["worker process"]["worker_ms"]
    assert "worker_process_ms" not in rows["in-process"]
    assert report["sampler"]["vocab"] == 49152 and report["sampler"]["wall_ms"] > 0
    assert "| worker process | 8 | 10 |" in stdout and "| greedy | 16 | 49152 |" in stdout
    (alone,) = report["scheduler"]  # schedule() and update() without the engine
    assert alone["seqs"] == 8 and alone["schedule_ms"] > 0 and alone["update_ms"] > 0
    assert "| steady decodes | 8 |" in stdout


@pytest.mark.slow
def test_bench_lora_smoke_runs_base_and_mixed_adapter_batches(tiny_llama_dir: Path, tmp_path: Path) -> None:
    stdout, report = _smoke("bench_lora.py", tiny_llama_dir, tmp_path / "lora.json")
    assert [(r["adapters"], r["rank"]) for r in report["rows"]] == [(1, 8), (2, 8)]
    assert all(r["base tok/s"] > 0 and r["LoRA tok/s"] > 0 for r in report["rows"])
    assert report["base, LoRA off tok/s"] > 0
    assert "| adapters | rank | base tok/s | LoRA tok/s | step time vs base |" in stdout


@pytest.mark.slow
def test_bench_quant_smoke_measures_every_format_against_the_first(tiny_llama_dir: Path, tmp_path: Path) -> None:
    stdout, report = _smoke("bench_quant.py", tiny_llama_dir, tmp_path / "quant.json", "--rounds", "2")
    rows = {row["format"]: row for row in report["rows"]}
    assert list(rows) == ["none", "int8"]
    # the projections in int8; where a C int8 kernel runs, the LM head's codes and scales beside its weight, which stays
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    has_kernel = cpu_gemm.has_int8() or cpu_gemm_portable.load() is not None
    head_codes = config["vocab_size"] * (config["hidden_size"] + 4) / 1e6 if has_kernel else 0.0
    assert rows["int8"]["weight_MB"] - head_codes < rows["none"]["weight_MB"]
    for row in rows.values():
        assert row["decode_1_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["mixed_tok_s"] > 0, row
        assert 0 <= row["top1_vs_generated"] <= 1 and row["perplexity"] > 1, row
    assert rows["none"]["top1_agreement"] == 1.0, "the reference's argmax against itself, on the same path"
    assert 0 <= rows["int8"]["top1_agreement"] <= 1
    assert "| int8 |" in stdout
    # two rounds of decode figures, the formats in turn: each figure their median, beside the range of its ratios
    for row in rows.values():
        rounds = row["decode_4_tok_s_rounds"]
        assert len(rounds) == 2 and row["decode_4_tok_s"] == sum(rounds) / 2, row
    low, high = rows["int8"]["decode_4_tok_s_ratio_range"]
    assert 0 < low <= high and rows["none"]["decode_4_tok_s_ratio_range"] == [1.0, 1.0]


@pytest.mark.slow
def test_bench_decode_phases_smoke_times_every_phase_where_the_runner_runs(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    stdout, report = _smoke(
        "bench_decode_phases.py", tiny_llama_dir, tmp_path / "phases.json", "--formats", "none,int8"
    )
    rows = report["rows"]
    assert [(row["format"], row["seqs"]) for row in rows] == [("none", 2), ("int8", 2)]
    for row in rows:
        assert row["step_ms"] > 0, row
        # the C runner takes bf16 Llama layers on CPUs with the AMX kernels; elsewhere the report says it did not run
        if cpu_gemm.load() is None:
            assert row["phases_ms"] is None and "the C runner did not run" in stdout
        else:
            assert all(ms > 0 for ms in row["phases_ms"].values()), row
    assert "| format | seqs | step ms | layers ms | input norm |" in stdout


def test_bench_blocks_smoke_measures_every_block_size_on_all_four_measures(tmp_path: Path) -> None:
    stdout, report = _smoke("bench_blocks.py", None, tmp_path / "blocks.json")
    sizes = [8, 16, 32, 64, 128]
    checks = report["correctness"]
    assert all(row["ok"] for row in checks), checks
    native = {row["block_size"]: row["rel_err"] for row in checks if row["kernel"] == "native"}
    assert native[128] is None and all(native[bs] < 1e-5 for bs in sizes[:4]), native  # 128 is beyond the kernel
    timed = [row for row in report["attention"] if row["timed"]]
    assert {row["block_size"] for row in timed} == set(sizes[:4])
    assert all(row["cpu_us_1t"] > 0 and row["wall_us_1t"] > 0 for row in timed), timed
    runs = [(row["block_size"], row["context"]) for row in timed if row["run"] == 4]  # 16-token units in runs of 4
    assert sorted(runs) == [(16, 64)] * 4 + [(16, 300)] * 4, runs  # 1 and 2 sequences, bf16 and fp32
    sched = report["scheduler"]
    assert sorted({row["block_size"] for row in sched}) == sizes
    for row in sched:  # a sequence's table has an entry per block; its prompt ends within 128 tokens past `context`
        assert row["decode_ms_per_step"] > 0 and row["plan_bytes_per_step"] > 0, row
        seqs, context, bs = row["seqs"], row["context"], row["block_size"]
        assert seqs * -(-context // bs) <= row["table_entries"] <= seqs * -(-(context + 128) // bs), row
    waste = {row["block_size"]: row for row in report["waste"]}
    for bs, row in waste.items():  # a running sequence leaves less than one block unused at its tail
        assert 0 < row["stored_share"] <= 1 and 0 <= row["wasted_per_seq"] < bs + 2, row
    assert waste[8]["stored_share"] >= waste[128]["stored_share"], waste
    prefix = {row["block_size"]: row for row in report["prefix"]}
    for bs in sizes:  # only full blocks of the 1,000 shared tokens are found: never more than the shared tokens
        assert 0 < prefix[bs]["shared_system_prompt"] < 1 and 0 < prefix[bs]["multi_turn_chat"] < 1, prefix[bs]
    assert prefix[8]["shared_system_prompt"] >= prefix[128]["shared_system_prompt"], prefix
    assert "## (c) tail waste when the pool is full" in stdout and "| 128 | - | True |" in stdout
    assert report["machine"]["loadavg_before"] and report["loadavg_after"]


@pytest.mark.slow
def test_bench_cpu_peer_smoke_measures_every_format_and_the_bandwidth(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--smoke: minivllm's formats and the copy bandwidth, without llama.cpp (no build in CI)."""
    stdout, report = _smoke("bench_cpu_peer.py", tiny_llama_dir, tmp_path / "peer.json")
    rows = {row["format"]: row for row in report["rows"]}
    assert list(rows) == ["float32", "bf16", "int8"] and report["copy_GB_s"] > 0
    assert "llama.cpp" in report["skipped"] and all(row["engine"] == "minivllm" for row in rows.values())
    for row in rows.values():
        assert row["single_tok_s"] > 0 and row["batch_tok_s"] > 0 and row["share_of_copy"] > 0, row
    assert rows["int8"]["weight_MB"] < rows["bf16"]["weight_MB"] < rows["float32"]["weight_MB"]
    assert rows["float32"]["within_0.5_of_fp32"] == 1.0, "the reference against itself"
    assert 0 <= rows["int8"]["within_0.5_of_fp32"] <= 1
    assert "| minivllm | int8 |" in stdout
