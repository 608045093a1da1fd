"""What the engine is built to (scheduler_node/engine/builder.py) and which model folder `--model` names
(scheduler_node/engine/model_path.py), checked before any worker is waited for; errors name the flag."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from proto.parallel import ParallelLayout
from scheduler_node.engine.builder import (
    check_model_split,
    check_speculative,
    kv_bytes_per_token_per_layer,
    model_limit,
    resolve_max_model_len,
    with_block_bytes,
)
from scheduler_node.engine.model_path import resolve_model, served_name
from settings.engine import EngineConfig
from settings.scheduler import SchedulerConfig
from settings.speculative import SpeculativeConfig

pytestmark = pytest.mark.unit

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 64, "num_hidden_layers": 4, "max_position_embeddings": 2048}  # fmt: skip


def model_folder(root: Path, config: dict[str, object], weights: str = "model.safetensors") -> Path:
    folder = root / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / weights).touch()
    return folder


def test_max_model_len_is_the_models_capped_at_the_kv_capacity() -> None:
    assert resolve_max_model_len(0, model_limit=2048, num_blocks=200, block_size=16) == 2048
    assert resolve_max_model_len(0, 2048, 100, 16) == 1600, "the KV holds fewer tokens than the model allows"
    assert resolve_max_model_len(1000, 2048, 100, 16) == 1000
    assert resolve_max_model_len(1600, 1024, 100, 16) == 1024, "never past the model's own limit"
    with pytest.raises(ValueError, match="--max-model-len 1601 needs more KV than the workers have"):
        resolve_max_model_len(1601, 2048, 100, 16)


def test_the_model_folder_is_checked_and_split(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, LLAMA)
    assert resolve_model(str(folder)) == folder.resolve() and served_name(str(folder)) == "my-model"
    assert model_limit(folder) == 2048
    check_model_split(folder, ParallelLayout(2, 2))
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the model's 8 attention heads"):
        check_model_split(folder, ParallelLayout(3))


def test_a_folder_without_a_config_or_weights_is_refused(tmp_path: Path) -> None:
    """(Unsupported architectures, pickles, hub ids and missing paths: tests/worker_node/test_model_loading.py.)"""
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        resolve_model(str(model_folder(tmp_path, LLAMA, "notes.txt")))
    assert served_name("org/some-model") == "org/some-model"  # a hub id is served as given


def _folder(path: Path, vocab: int, tokens: dict[str, int] | None = None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    if tokens is not None:
        (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": tokens}, "added_tokens": []}))
    return path


def test_speculation_is_refused_at_start_where_it_cannot_run(tmp_path: Path) -> None:
    """A draft model whose folder, vocabulary or tokenizer is not the target's: a clear error naming the key,
    before any worker loads. N-gram proposals run anywhere (pipeline parallelism: tests/fidelity)."""
    target = _folder(tmp_path / "target", 8, {"a": 0, "b": 1})
    check_speculative(target, SpeculativeConfig())

    def draft(folder: Path) -> None:
        check_speculative(target, SpeculativeConfig(method="draft_model", model=str(folder)))

    draft(target)
    draft(_folder(tmp_path / "same", 8, {"a": 0, "b": 1}))
    with pytest.raises(ValueError, match=r"speculative_config.model: .*missing is not a model folder"):
        draft(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft's vocabulary \(9 tokens\)"):
        draft(_folder(tmp_path / "bigger", 9, {"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="speculative_config.model: .* has another tokenizer"):
        draft(_folder(tmp_path / "other", 8, {"a": 1, "b": 0}))


def test_a_block_in_bytes_is_the_largest_block_of_tokens_that_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # SmolLM2-135M's shape: 3 KV heads of 64 dims in bf16: 768 bytes of K and V per token per layer.
    folder = model_folder(tmp_path, {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                                     "torch_dtype": "bfloat16"})  # fmt: skip
    assert (
        kv_bytes_per_token_per_layer(folder, "auto") == 768 and kv_bytes_per_token_per_layer(folder, "float32") == 1536
    )
    config = EngineConfig(scheduler=SchedulerConfig(kv_block_bytes=16_000))  # article 000's 16KB: 20.8 tokens
    with caplog.at_level(logging.INFO, "scheduler_node.engine.builder"):
        assert with_block_bytes(config, folder).scheduler.block_size == 16
    assert "block_size 16000 bytes is 20.8 tokens of this model's KV (768 bytes per token per layer)" in caplog.text
    assert (
        with_block_bytes(EngineConfig(scheduler=SchedulerConfig(kv_block_bytes=2**20)), folder).scheduler.block_size
        == 128
    )
    assert with_block_bytes(EngineConfig(), folder) == EngineConfig()  # no bytes: --block-size as given
    with pytest.raises(ValueError, match=r"block_size 4096 bytes holds 5.3 tokens .* the smallest block is 8 tokens"):
        with_block_bytes(EngineConfig(scheduler=SchedulerConfig(kv_block_bytes=4096)), folder)
