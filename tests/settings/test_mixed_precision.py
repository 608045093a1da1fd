"""engine.mixed_precision in a config file: mapped onto --dtype, --quantization and --kv-cache-dtype; what the
engine cannot run refused naming the key; the article's own block (fp8 matmuls, an fp16 KV cache, bf16 embeddings)
on a GPU and on a CPU (fp8 weights widened there, logged once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scheduler_node.cli.scheduler import build_parser as scheduler_parser
from scheduler_node.cli.serve import build_parser as serve_parser
from settings.config_file import parse_args
from settings.mixed_precision import MixedPrecisionError, mixed_precision_flags
from tests.seeds.blocks import block

pytestmark = pytest.mark.unit


def mp(**section: str) -> dict[str, object]:
    return {"mixed_precision": section}


def test_settings_map_onto_the_flags() -> None:
    assert mixed_precision_flags(mp(matmul="int8", kv_cache="int8", embedding="bf16")) == {
        "dtype": "bfloat16",
        "quantization": "int8",
        "kv_cache_dtype": "int8",
    }
    assert mixed_precision_flags(mp(matmul="fp32", kv_cache="fp32")) == {
        "dtype": "float32",
        "quantization": "none",
        "kv_cache_dtype": "auto",
    }
    assert mixed_precision_flags(mp(matmul="awq", kv_cache="fp8")) == {
        "quantization": "awq",
        "kv_cache_dtype": "fp8_e4m3",
    }
    assert mixed_precision_flags(mp(matmul="fp8"), device="cuda") == {"quantization": "fp8"}
    assert mixed_precision_flags(mp(matmul="bf16", kv_cache="fp32")) == {
        "dtype": "bfloat16",
        "quantization": "none",
        "kv_cache_dtype": "float32",
    }


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_articles_block_runs_on_a_gpu_and_on_a_cpu(device: str, caplog: pytest.LogCaptureFixture) -> None:
    article = yaml.safe_load(block("mixed_precision").text)["engine"]  # matmul fp8, kv_cache fp16, embedding bf16
    with caplog.at_level("WARNING", logger="settings.mixed_precision"):
        flags = mixed_precision_flags(article, device)
        mixed_precision_flags(article, device)
    assert flags == {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "float16"}
    widened = [r for r in caplog.records if "stored as fp8 and widened to bfloat16" in r.getMessage()]
    assert len(widened) == (1 if device == "cpu" else 0)  # once per process, however often a config is read


@pytest.mark.parametrize(
    ("section", "device", "message"),
    [
        (mp(matmul="fp8", kv_cache="fp4", embedding="bf16"), "cuda", r"kv_cache fp4: one of auto, bf16"),
        (mp(matmul="bf16", embedding="fp32"), None, r"embedding fp32: the model runs in one float dtype"),
        (mp(embedding="int8"), None, r"embedding int8: embeddings stay in a float dtype"),
        (mp(matmul="int3"), None, r"matmul int3: one of"),
        (mp(attention="bf16"), None, r"engine.mixed_precision: a mapping of matmul, kv_cache, embedding"),
        ({"scheduler": {}}, None, r"engine: only engine.mixed_precision"),
    ],
)
def test_impossible_settings_are_refused(section: dict[str, object], device: str | None, message: str) -> None:
    with pytest.raises(MixedPrecisionError, match=message):
        mixed_precision_flags(section, device)


def test_a_config_file_sets_the_flags_and_refuses_a_contradiction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("engine:\n  mixed_precision:\n    matmul: int8\n    kv_cache: fp8\n    embedding: bf16\n")
    args = parse_args(serve_parser(), ["--config", str(config)])
    assert (args.dtype, args.quantization, args.kv_cache_dtype) == ("bfloat16", "int8", "fp8_e4m3")
    args = parse_args(serve_parser(), ["--config", str(config), "--quantization", "none"])  # flags win
    assert args.quantization == "none"
    config.write_text("quantization: fp8\nengine:\n  mixed_precision:\n    matmul: int8\n")
    with pytest.raises(SystemExit):
        parse_args(serve_parser(), ["--config", str(config)])
    assert "engine.mixed_precision says quantization int8, the key quantization says fp8" in capsys.readouterr().err
    config.write_text("device: cpu\nengine:\n  mixed_precision: {matmul: fp8, kv_cache: fp16, embedding: bf16}\n")
    args = parse_args(serve_parser(), ["--config", str(config)])
    assert (args.dtype, args.quantization, args.kv_cache_dtype) == ("bfloat16", "fp8", "float16")
    config.write_text("engine:\n  mixed_precision:\n    kv_cache: int8\n")  # the scheduler has no KV cache
    with pytest.raises(SystemExit):
        parse_args(scheduler_parser(), ["--config", str(config)])
    assert "sets kv_cache_dtype, a flag of the workers" in capsys.readouterr().err
