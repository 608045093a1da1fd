"""Load an HF safetensors folder into our Llama-family model, fusing q/k/v and gate/up as we go."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.backend import AttentionBackend
from worker_node.models.config import ModelConfig
from worker_node.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(
    folder: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions)
    hf = read_safetensors(folder)
    state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        state[name] = _hf_tensor(hf, name, config)
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = model.rotary.__class__(config, max_positions)  # buffers were created on meta
    model.to(device=device, dtype=dtype)
    model.rotary.to(dtype=torch.float32)
    model.eval()
    logger.info("loaded %s (%s, %d layers) in %s", folder.name, config.model_type, config.num_layers, dtype)
    return model


def _hf_tensor(hf: dict[str, torch.Tensor], name: str, config: ModelConfig) -> torch.Tensor:
    if name == "lm_head.weight" and (config.tie_word_embeddings or name not in hf):
        return hf["model.embed_tokens.weight"]
    hf_name = name if name.startswith("lm_head") else f"model.{name}"
    for fused, parts in _FUSED.items():
        if fused in hf_name:
            return torch.cat([hf[hf_name.replace(fused, part)] for part in parts])
    if hf_name not in hf:
        raise KeyError(f"weight {hf_name} is missing from the checkpoint")
    return hf[hf_name]
