"""A worker's settings are declared once (WorkerOptions): vllm-worker's flags are derived from them, and the command
line vllm-serve and the offline LLM hand a worker (worker_argv) parses back into the same settings. `--kv-offload-disk`
is checked by trying it: a folder this process can write in (created when missing), else one line naming the flag
(a read-only mount: tests/e2e/test_offload.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from settings.cli import Part, add_settings, from_args
from settings.fast_paths import FastPaths
from settings.worker import WorkerOptions, offload_dir_problem, parse_size, worker_argv

pytestmark = pytest.mark.unit


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_settings(p, [Part(WorkerOptions)])
    return p


def test_the_flags_defaults_are_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("MINIVLLM_CPU_GEMM", "MINIVLLM_NATIVE_DECODE", "MINIVLLM_HUGE_PAGES", "MINIVLLM_INT8_ACT_BITS"):
        monkeypatch.delenv(env, raising=False)
    assert from_args(WorkerOptions, parser().parse_args([])) == WorkerOptions()


def test_settings_survive_the_command_line() -> None:
    options = WorkerOptions(device="cpu", kv_cache_memory=2**24, swap_space=0.5, threads=2, kv_cache_dtype="int8",
                            kv_offload_ram=0.25, kv_offload_disk="/tmp/kv", kv_offload_disk_size=1.5,
                            cuda_graph_sizes="1,2", local_address="10.0.0.2", batch_invariant=True,
                            overlap_steps="on", zmq_curve_dir="/keys",
                            fast_paths=FastPaths(cpu_gemm=False, int8_act_bits="8"))  # fmt: skip
    argv = worker_argv(options)
    assert from_args(WorkerOptions, parser().parse_args(argv)) == options
    assert "--batch-invariant" in argv and "--no-cpu-gemm" in argv, "a switch is passed as its value"
    assert "--scheduler-address" not in argv, "the launcher says where to join"
    assert worker_argv(WorkerOptions()) == [], "a setting at its default is left out"


def test_sizes_take_units() -> None:
    assert [parse_size(t) for t in ("4GiB", "512MiB", "256KiB", "1e9", "1000", " 2kb ")] == [
        4 * 2**30, 512 * 2**20, 256 * 2**10, 10**9, 1000, 2000]  # fmt: skip
    with pytest.raises(ValueError):
        parse_size("lots")


def test_the_attention_backend_is_a_built_in_name_or_a_class() -> None:
    assert parser().parse_args(["--attention-backend", "my.module:Backend"]).attention_backend == "my.module:Backend"
    with pytest.raises(SystemExit):
        parser().parse_args(["--attention-backend", "fastest"])


def test_a_writable_folder_is_taken_and_a_missing_one_created(tmp_path: Path) -> None:
    assert offload_dir_problem(str(tmp_path)) == ""
    nested = tmp_path / "a" / "b"
    assert offload_dir_problem(str(nested)) == "" and nested.is_dir()
    assert list(nested.iterdir()) == [], "the probe leaves nothing behind"


def test_a_file_or_a_folder_under_a_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("x")
    assert offload_dir_problem(str(file)) == f"--kv-offload-disk {file}: not a folder"
    assert offload_dir_problem(str(file / "sub"), "kv_offload_disk:").startswith(f"kv_offload_disk: {file}/sub: ")
