"""Which format a model runs in: a checkpoint's quantization_config wins, a flag that contradicts it or a format a
full-precision checkpoint cannot be made into is refused at start, naming the flag or the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proto.quantization import QuantizationError, resolve_quantization

pytestmark = pytest.mark.unit


def _folder(tmp_path: Path, quantization_config: dict | None) -> Path:
    config: dict[str, object] = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_checkpoint_format_wins_and_a_contradicting_flag_is_refused(tmp_path: Path) -> None:
    awq = _folder(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128})
    assert resolve_quantization("auto", awq) == "awq"
    assert resolve_quantization("awq", awq) == "awq"
    with pytest.raises(QuantizationError, match=r"--quantization int8: .* awq checkpoint .*quant_method"):
        resolve_quantization("int8", awq)


def test_a_format_a_full_precision_checkpoint_cannot_become_is_refused(tmp_path: Path) -> None:
    full = _folder(tmp_path, None)
    assert resolve_quantization("auto", full) == "none"
    assert resolve_quantization("int8", full) == "int8"
    with pytest.raises(QuantizationError, match=r"--quantization awq: .* full-precision checkpoint"):
        resolve_quantization("awq", full)
    with pytest.raises(QuantizationError, match="quantization: must be one of"):
        resolve_quantization("int3", full)


def test_an_unknown_checkpoint_method_is_named(tmp_path: Path) -> None:
    gptq = _folder(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(QuantizationError, match=r"quantization_config.quant_method 'gptq' is not supported"):
        resolve_quantization("auto", gptq)
