"""`vllm-convert --quantization awq`: the activation-aware search keeps the full-precision function while it scales,
beats plain rounding on the calibration activations, and writes a checkpoint our AWQ loader takes as is; bad
options are refused naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minivllm.tiny_models import build_tiny_model
from tests.support.engine import load_runner
from worker_node.convert import main as convert_main
from worker_node.models.awq_calibration import CALIBRATION_TEXT
from worker_node.models.awq_convert import (
    AwqConvertError,
    calibration_ids,
    calibration_inputs,
    fake_quantize,
    pick_group,
    quantize_folder,
    scale_layer,
    search_clip,
)
from worker_node.models.quant_linear import QuantLinear

pytestmark = pytest.mark.model

CALIB = " ".join(f"sample {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(120))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny Llama whose projections' input widths (128, 192) split into groups of 64, not 128."""
    return build_tiny_model(
        "llama", tmp_path_factory.mktemp("awq-src"), smollm2_dir, hidden_size=128, intermediate_size=192
    )


def _model(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # outlier input channels, as trained models have
            layer.input_layernorm.weight[:4] *= 20
            layer.post_attention_layernorm.weight[:4] *= 20
    return model


@torch.inference_mode()
def test_scales_keep_the_function_and_beat_rounding(source: Path) -> None:
    from transformers import AutoTokenizer

    model = _model(source)
    ids = torch.tensor([AutoTokenizer.from_pretrained(source)(CALIB)["input_ids"][:256]])
    before = model(input_ids=ids).logits
    layers = list(model.model.layers)
    inputs = calibration_inputs(model, ids, layers)
    layer, x = layers[0], inputs[0]["gate_up"]
    plain = [fc.weight.float().clone() for fc in (layer.mlp.gate_proj, layer.mlp.up_proj)]

    def error(weights: list[torch.Tensor], x: torch.Tensor) -> float:
        return sum(float((x @ (fake_quantize(w, 64) - w).t()).pow(2).mean()) for w in weights)

    rounding = error(plain, x)
    scale_layer(layer, inputs[0], 64)
    scaled = [fc.weight.float() for fc in (layer.mlp.gate_proj, layer.mlp.up_proj)]
    assert error(scaled, inputs[0]["gate_up"]) < 0.9 * rounding  # salient channels got finer steps
    torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-3, rtol=1e-3)  # folded exactly
    w, xd = layer.mlp.down_proj.weight.float(), inputs[0]["down"]
    clipped = search_clip(xd, w, 64)
    assert float((xd @ (fake_quantize(clipped, 64) - w).t()).pow(2).mean()) <= error([w], xd)


def test_converted_checkpoint_loads_in_the_awq_layout(source: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "awq"
    rc = convert_main(
        ["--input", str(source), "--output", str(out), "--quantization", "awq", "--calib-file", str(calib)]
    )
    assert rc == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config | {"modules_to_not_convert": None} == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,  # the largest that splits 128 and 192
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    runner = load_runner(out, 16, 16)  # auto: the checkpoint's quantization_config
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.method.name == "awq" for m in layers)


def test_the_built_in_text_fills_the_calibration_rows(source: Path) -> None:
    from transformers import AutoTokenizer

    ids = calibration_ids(AutoTokenizer.from_pretrained(source), CALIBRATION_TEXT)
    assert ids.shape == (2, 512)  # MAX_TOKENS of it


def test_bad_options_are_refused(source: Path, tmp_path: Path) -> None:
    with pytest.raises(AwqConvertError, match="--group-size 128"):
        pick_group([128, 192], 128)
    with pytest.raises(AwqConvertError, match="--calib-file"):
        quantize_folder(source, tmp_path / "x", 64, "too short")
    out = str(tmp_path / "y")
    assert convert_main(["--input", str(source), "--output", out, "--group-size", "64"]) == 2
    assert convert_main(["--input", str(source), "--output", out, "--quantization", "awq", "--link"]) == 2
    assert not Path(out).exists()
