"""A quantized checkpoint that does not hold together is refused as the worker loads it, naming the tensor or the
config key: a missing zero point, a packed tensor of the wrong shape, a group size the layers cannot split into."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import cpu_gemm, cpu_gemm_portable
from kernels.backend import select_attention_backend
from proto.quantization import QuantizationError
from tests.support.awq_checkpoint import write_awq_checkpoint
from worker_node.models.loader import load_model
from worker_node.models.quantize import weight_bytes

pytestmark = pytest.mark.model

CPU = torch.device("cpu")
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("awq-tiny") / "model"
    write_awq_checkpoint(tiny_llama_dir, folder, group=32)
    return folder


def _load(folder: Path, quantization: str = "auto") -> None:
    load_model(folder, select_attention_backend("torch", CPU), torch.float32, CPU, 64, quantization=quantization)


def _edited(awq_dir: Path, tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    folder = tmp_path / "edited"
    folder.mkdir()
    for f in awq_dir.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).symlink_to(f)
    state = load_file(str(awq_dir / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def test_the_awq_checkpoint_loads_and_a_missing_zero_point_is_named(awq_dir: Path, tmp_path: Path) -> None:
    _load(awq_dir)
    folder = _edited(awq_dir, tmp_path, lambda state: state.pop(f"{Q}.qzeros"))
    with pytest.raises(KeyError, match=f"{Q}.qzeros is missing"):
        _load(folder)


def test_a_packed_tensor_of_the_wrong_shape_is_named(awq_dir: Path, tmp_path: Path) -> None:
    folder = _edited(awq_dir, tmp_path, lambda s: s.update({f"{Q}.qweight": s[f"{Q}.qweight"][:, :-1].clone()}))
    with pytest.raises(RuntimeError, match=r"size mismatch for layers.0.self_attn.qkv_proj.qweight"):
        _load(folder)


def test_a_group_size_the_layers_do_not_split_into_is_named(awq_dir: Path, tmp_path: Path) -> None:
    config = json.loads((awq_dir / "config.json").read_text())
    config["quantization_config"]["group_size"] = 128  # the tiny model's layers have 64 inputs
    folder = tmp_path / "g128"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(awq_dir / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="quantization_config.group_size 128: a layer of 64 inputs"):
        _load(folder)
    with pytest.raises(QuantizationError, match="--quantization int8: .* awq checkpoint"):
        _load(awq_dir, "int8")


def test_an_awq_models_head_gets_its_int8_copy_where_a_kernel_multiplies_it(awq_dir: Path) -> None:
    """bf16 with AMX-INT8, or either dtype where the portable int8 kernel builds: the head (tied to the embedding,
    kept in the model dtype) gains int8 codes, counted in the weights held; elsewhere the head stays alone
    (quantize.quantize_head)."""
    backend = select_attention_backend("torch", CPU)
    model = load_model(awq_dir, backend, torch.bfloat16, CPU, 64, quantization="auto")
    portable = cpu_gemm_portable.load() is not None
    assert model.lm_head is not None and model.lm_head.weight.dtype == torch.bfloat16
    assert (model.lm_head.int8 is not None) == (cpu_gemm.has_int8() or portable)
    float32 = load_model(awq_dir, backend, torch.float32, CPU, 64, quantization="auto")
    assert (float32.lm_head.int8 is not None) == portable  # type: ignore[union-attr]
    if model.lm_head.int8 is not None:
        codes, scales = model.lm_head.int8
        assert codes.shape == model.lm_head.weight.shape and codes.dtype == torch.int8
        with_codes = weight_bytes(model)
        model.lm_head.int8 = None
        assert with_codes - weight_bytes(model) == codes.numel() + scales.numel() * scales.element_size()
