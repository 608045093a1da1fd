"""From the `architectures` entry of a config.json to the class that implements it."""

from __future__ import annotations

from worker_node.models.decoder import CausalLM
from worker_node.models.gemma2 import Gemma2ForCausalLM
from worker_node.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from worker_node.models.mixtral import MixtralForCausalLM

MODELS: dict[str, type[CausalLM]] = {  # keys: proto.architectures.SUPPORTED_ARCHITECTURES
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(MODELS)}")
    return MODELS[architecture]
