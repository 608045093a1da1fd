"""What a model folder must hold, checked the same way by both sides: a supported architecture (proto/
architectures.py), weights as safetensors or one GGUF and never a pickle (proto/checkpoints.py), and where the
default model is cached (proto/model_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.architectures import architecture_of
from proto.checkpoints import GGUF, SAFETENSORS, PickleCheckpointError, weight_files
from proto.model_cache import DEFAULT_MODEL_NAME, cache_dir, default_model_dir

pytestmark = pytest.mark.unit


def test_architecture_from_config_or_model_type() -> None:
    assert architecture_of({"architectures": ["Gemma2ForCausalLM"]}) == "Gemma2ForCausalLM"
    assert architecture_of({"model_type": "llama"}) == "LlamaForCausalLM"  # converted GGUFs may lack the list
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel is not supported; supported: Llama"):
        architecture_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="model_type 'falcon' is not supported"):
        architecture_of({"model_type": "falcon"})


def test_weights_are_safetensors_shards_or_one_gguf(tmp_path: Path) -> None:
    for name in ("model-00002.safetensors", "model-00001.safetensors", "tokenizer.json"):
        (tmp_path / name).touch()
    kind, files = weight_files(tmp_path)
    assert (kind, [f.name for f in files]) == (SAFETENSORS, ["model-00001.safetensors", "model-00002.safetensors"])
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "model.Q8_0.gguf").touch()
    assert weight_files(gguf) == (GGUF, [gguf / "model.Q8_0.gguf"])
    (gguf / "other.gguf").touch()
    with pytest.raises(ValueError, match="several GGUF files"):
        weight_files(gguf)


def test_a_pickle_or_nothing_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").touch()
    with pytest.raises(PickleCheckpointError, match="pytorch_model.bin is a pickle checkpoint"):
        weight_files(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        weight_files(empty)


def test_the_default_model_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "mine"))
    assert default_model_dir() == tmp_path / "mine" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("MINIVLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "minivllm"
