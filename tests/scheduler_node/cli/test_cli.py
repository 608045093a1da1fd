"""Every command has --help, and --config FILE.yaml where flags win."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proto.parallel import ParallelLayout
from scheduler_node.cli.scheduler import build_parser as scheduler_parser
from scheduler_node.cli.scheduler import engine_config
from scheduler_node.cli.serve import build_parser as serve_parser
from scheduler_node.engine.builder import WorldPlan
from scheduler_node.engine.placement import place
from scheduler_node.engine.topology import single_island
from settings.config_file import parse_args
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "module",
    [
        "scheduler_node.cli.scheduler",
        "scheduler_node.cli.serve",
        "clients.client",
        "router_node.main",
        "worker_node.worker",
        "worker_node.convert",
    ],
)
def test_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout


def test_config_file_sets_defaults_and_flags_win(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("max-num-seqs: 7\nblock_size: 32\nport: 6000\n")
    args = parse_args(scheduler_parser(), ["--config", str(config), "--port", "7000"])
    assert (args.max_num_seqs, args.block_size, args.port) == (7, 32, 7000)


def test_config_file_covers_worker_flags_in_serve(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("kv-cache-memory: 2GiB\nnum_workers: 1\n")
    args = parse_args(serve_parser(), ["--config", str(config)])
    assert args.kv_cache_memory == 2 * 2**30


def test_quantization_reaches_the_assignment_from_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("quantization: int8\n")
    args = parse_args(serve_parser(), ["--config", str(config)])
    engine = engine_config(args)
    assert engine.quantization == "int8"
    plan = WorldPlan(engine, tmp_path, place(single_island(1), ParallelLayout(1, 1), worker_chooses_device=True))
    assert plan.assignment(0).quantization == "int8"


def test_lora_capacity_reaches_the_assignment(tmp_path: Path) -> None:
    """A worker that captures decode graphs sizes its LoRA slot bank from these (0 slots: LoRA off)."""
    where = place(single_island(1), ParallelLayout(1, 1), worker_chooses_device=True)
    flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"]
    on = WorldPlan(engine_config(parse_args(serve_parser(), flags)), tmp_path, where).assignment(0)
    assert (on.max_loras, on.max_lora_rank) == (3, 32)
    off = WorldPlan(engine_config(parse_args(serve_parser(), [])), tmp_path, where).assignment(0)
    assert (off.max_loras, off.max_lora_rank) == (0, 0)


def test_unknown_config_key_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("max-num-sequences: 7\n")
    with pytest.raises(SystemExit):
        parse_args(scheduler_parser(), ["--config", str(config)])
    assert "unknown key 'max-num-sequences'" in capsys.readouterr().err


def test_scheduler_never_imports_torch() -> None:
    code = (
        "import sys, scheduler_node.cli.scheduler, scheduler_node.cli.serve, clients.client, "
        "router_node.main; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# Nested 30,000 deep: Python's JSON and YAML parsers recurse once a level. A command line's argument holds at most
# 128 KiB, which lists fit in; the objects go through a config file.
DEEP_LIST = "[" * 30_000 + "]" * 30_000
DEEP_OBJECT = '{"a":' * 30_000 + "1" + "}" * 30_000


@pytest.mark.parametrize(
    "flags, config, words",
    [
        (["--speculative-config", DEEP_LIST], "", "argument --speculative-config: speculative_config: nested too"),
        ([], f"speculative-config: '{DEEP_OBJECT}'\n", "speculative-config in CONFIG: speculative_config: nested too"),
        ([], f"speculative-config: {DEEP_LIST}\n", "cannot read config CONFIG: its YAML: nested too deeply"),
    ],
    ids=["flag", "config-json", "config-yaml"],
)
def test_text_nested_too_deeply_is_a_one_line_usage_error(
    flags: list[str], config: str, words: str, tmp_path: Path
) -> None:
    """Not a RecursionError traceback and exit 1: argparse's error line naming the flag or file, and exit 2."""
    path = tmp_path / "deep.yaml"
    path.write_text(config)
    argv = [*flags, "--config", str(path)] if config else flags
    out = subprocess.run([sys.executable, "-m", "scheduler_node.cli.serve", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.splitlines()[-1].startswith("vllm-serve: error: " + words.replace("CONFIG", str(path)))


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "no replicas: give at least one --replica"),
        (["--replica", "127.0.0.1:1"], "address and model are required"),
        (["--replica", "127.0.0.1:1,model=m", "--routing-strategy", "fastest"], "--routing-strategy must be one of"),
        (["--replica", "127.0.0.1:1,model=m", "--probe-interval", "0"], "--probe-interval must be > 0"),
    ],
)
def test_router_names_what_is_wrong_with_its_flags(argv: list[str], words: str) -> None:
    command = [sys.executable, "-m", "router_node.main", "--port", "0", *argv]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and words in out.stderr, out.stderr
