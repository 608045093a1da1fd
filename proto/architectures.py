"""The model architectures the workers implement, named as HF writes them in config.json's `architectures`.

A contract between the two sides: the scheduler refuses an unsupported model before it waits for workers (it
never imports the models), and the workers' registry (worker_node/models/registry.py) holds exactly these.
Pure Python.
"""

from __future__ import annotations

from typing import Any

from proto.multimodal import is_multimodal, text_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "MixtralForCausalLM",
)

# Configs written without `architectures` (some conversions): the causal-LM class of their model_type.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def architecture_of(config: dict[str, Any]) -> str:
    """The supported architecture a config.json describes (a multimodal checkpoint's: its text decoder's,
    proto/multimodal.py); ValueError naming it (and the choices) if none."""
    if is_multimodal(config):
        config = text_config(config)
    named = config.get("architectures") or []
    if not named and config.get("model_type") in _BY_MODEL_TYPE:
        named = [_BY_MODEL_TYPE[config["model_type"]]]
    for name in named:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    what = ", ".join(named) or f"model_type {config.get('model_type')!r}"
    raise ValueError(f"architecture {what} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
