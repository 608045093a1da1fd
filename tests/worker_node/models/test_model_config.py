"""Reading config.json: the architecture (and the registry behind it), per-layer sliding windows as HF decides
them, and precise errors for what is not supported."""

from __future__ import annotations

from typing import Any

import pytest

from proto.architectures import SUPPORTED_ARCHITECTURES
from worker_node.models.config import ModelConfig, layer_windows
from worker_node.models.registry import MODELS

pytestmark = pytest.mark.unit

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}


def config(**fields: Any) -> dict[str, Any]:
    return {**BASE, **fields}


def test_the_registry_holds_exactly_the_supported_architectures() -> None:
    assert set(MODELS) == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({"model_type": "mistral", "sliding_window": 8}, (8, 8, 8, 8)),  # every layer
        ({"model_type": "mistral", "sliding_window": None}, (0, 0, 0, 0)),
        ({"model_type": "phi3", "sliding_window": 12}, (12, 12, 12, 12)),
        ({"model_type": "gemma2", "sliding_window": 8}, (8, 0, 8, 0)),  # even layers slide
        ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}, (0, 0, 0, 0)),
        (
            {"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2},
            (0, 0, 8, 8),
        ),
        (
            {"model_type": "qwen3", "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"] * 2},
            (0, 8, 0, 8),
        ),
    ],
)
def test_layer_windows_as_hf_decides_them(fields: dict[str, Any], windows: tuple[int, ...]) -> None:
    assert layer_windows(config(**fields)) == windows


def test_layer_types_must_cover_every_layer() -> None:
    with pytest.raises(ValueError, match="layer_types lists 2 layers, num_hidden_layers is 4"):
        layer_windows(config(sliding_window=8, layer_types=["sliding_attention"] * 2))


def test_gemma2_numbers() -> None:
    c = ModelConfig.from_dict(
        config(
            architectures=["Gemma2ForCausalLM"],
            model_type="gemma2",
            head_dim=16,
            query_pre_attn_scalar=64,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu",  # Gemma's MLP reads hidden_activation
        )
    )
    assert (c.attention_scale, c.attn_logit_softcap, c.final_logit_softcap) == (64**-0.5, 50.0, 30.0)
    assert c.hidden_act == "gelu_pytorch_tanh"


def test_unsupported_rope_and_activation_are_named() -> None:
    llama = config(architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_dict({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden activation 'relu2' is not supported"):
        ModelConfig.from_dict({**llama, "hidden_act": "relu2"})
