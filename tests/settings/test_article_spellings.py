"""The articles' command lines and config keys, as written: article 003's config.yaml started as `vllm-serving
--config config.yaml --port 8000` (HTTP on 8000), article 000's table (max_num_seqs 128, block_size 16KB,
scheduler_interval 50ms, preemption_mode elastic), `--kv-offload-disk-size 20GB`; each per-command spelling and unit
checked, with the errors that name the key or flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from settings.cli import Spelling
from settings.commands import COMMANDS, command_parser
from settings.config_file import parse_args
from tests.seeds.blocks import block

pytestmark = pytest.mark.unit

ARTICLE_003 = block("config_yaml").text + "\n"  # article 003, section 3.1
ARTICLE_000 = block("recommended_settings").text + "\n"  # article 000's table, section 5.1


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    return parse_args(command_parser(command, "test"), argv)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_article_003s_config_and_port_serve_http_on_8000(tmp_path: Path) -> None:
    args = parse("vllm-serve", ["--config", write(tmp_path, ARTICLE_003), "--port", "8000"])
    assert (args.openai_port, args.port) == (8000, 50051)  # HTTP on 8000; gRPC at its default
    assert (args.model, args.tensor_parallel_size, args.pipeline_parallel_size) == ("default", 2, 1)
    assert (args.block_size, args.enable_prefix_caching, args.max_num_seqs) == (16, True, 128)


def test_vllm_serve_spells_grpc_port_and_keeps_openai_port() -> None:
    args = parse("vllm-serve", ["--grpc-port", "7000", "--openai-port", "7001"])
    assert (args.port, args.openai_port) == (7000, 7001)
    assert parse("vllm-serve", []).openai_port == 8000
    help_text = command_parser("vllm-serve", "test").format_help()
    assert "--openai-port is its former name" in help_text and "--grpc-port" in help_text
    # vllm-scheduler keeps --port for gRPC (article 003's multi-node line), and --openai-port for HTTP.
    scheduler = parse("vllm-scheduler", ["--port", "7000", "--openai-port", "7001"])
    assert (scheduler.port, scheduler.openai_port) == (7000, 7001)
    with pytest.raises(SystemExit):
        parse("vllm-scheduler", ["--grpc-port", "7000"])


def test_a_serve_config_keys_its_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("vllm-serve", ["--config", write(tmp_path, "port: 8001\ngrpc-port: 7000\n")])
    assert (args.openai_port, args.port) == (8001, 7000)
    with pytest.raises(SystemExit):
        parse("vllm-serve", ["--config", write(tmp_path, "port: 8001\nopenai-port: 8002\n")])
    assert "'port' and 'openai-port' are one setting (--port); keep one" in capsys.readouterr().err


def test_article_000s_table_as_a_config_file(tmp_path: Path) -> None:
    for command in ("vllm-scheduler", "vllm-serve"):
        args = parse(command, ["--config", write(tmp_path, ARTICLE_000)])
        assert (args.max_num_seqs, args.preemption_mode, args.scheduler_delay) == (128, "elastic", 0.05), command
        assert (args.block_size, args.kv_block_bytes) == (16, 16_000), command  # tokens once the model is known


def test_units_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("vllm-serve", ["--kv-offload-disk-size", "20GB", "--scheduler-interval", "0.05s"])
    assert args.kv_offload_disk_size == pytest.approx(20e9 / 2**30) and args.scheduler_delay == 0.05
    assert parse("vllm-worker", ["--kv-offload-disk-size", "20GB", "--swap-space", "512MiB"]).swap_space == 0.5
    assert parse("vllm-scheduler", ["--scheduler-delay", "50ms", "--kv-block-bytes", "16KiB"]).kv_block_bytes == 16384
    with pytest.raises(SystemExit):
        parse("vllm-scheduler", ["--block-size", "16KB"])
    assert "block_size 16KB is a size in bytes: give it as --kv-block-bytes 16KB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("vllm-serve", ["--scheduler-delay", "soon"])
    assert "argument --scheduler-delay/--scheduler-interval: expected seconds" in capsys.readouterr().err


def test_block_bytes_twice_in_one_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("vllm-scheduler", ["--config", write(tmp_path, "block_size: 16KB\nkv_block_bytes: 32KB\n")])
    assert "block_size 16KB and kv_block_bytes both size a KV block; keep one" in capsys.readouterr().err


def test_a_worker_may_say_its_model_and_shape() -> None:
    argv = ["--model", "m", "--scheduler-address", "h:50051", "--tensor-parallel-size", "2"]
    args = parse("vllm-worker", [*argv, "--pipeline-parallel-size", "2"])
    assert (args.model, args.scheduler_address, args.tensor_parallel_size, args.pipeline_parallel_size) == (
        "m", "h:50051", 2, 2
    )  # fmt: skip
    assert parse("vllm-worker", []).model == ""  # says nothing: serves what it is assigned
    assert parse("vllm-scheduler", []).model == ""  # the first worker's
    assert parse("vllm-scheduler", []).worker_host == ""  # --host's: remote workers reach both there
    assert parse("vllm-serve", []).worker_host == "127.0.0.1"  # its workers are its children
    assert parse("vllm-serve", []).model == "default"


def test_a_spelling_is_long_flags() -> None:
    with pytest.raises(ValueError, match="long flags"):
        Spelling(("-p",))
    assert COMMANDS["vllm-serve"].spellings["openai_port"].flags[0] == "--port"
