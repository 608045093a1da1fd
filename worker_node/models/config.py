"""The part of an HF config.json that our decoders need, read and checked once at load.

Every supported architecture is a decoder of the same shape (embedding, N layers of attention + MLP or
experts, norm, LM head); what differs is kept here as plain numbers and flags: per-layer sliding windows,
soft-caps, the attention scale, the activation, partial RoPE, experts. The model classes decide the structure
(which norms, where) from their architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.architectures import architecture_of
from proto.multimodal import text_config

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "llama3")
_QWEN_TYPES = ("qwen2", "qwen3")  # windows only on layers from max_window_layers on, when use_sliding_window


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # the registry key, e.g. "Gemma2ForCausalLM"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the MLP width, or each expert's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int  # leading dims of each head that RoPE rotates (partial_rotary_factor < 1 leaves the rest)
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_windows: tuple[int, ...]  # per layer: tokens a query sees (itself included), 0 for full attention
    hidden_act: str = "silu"
    attention_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_logit_softcap: float = 0.0  # scores become cap * tanh(scores / cap); 0: none
    final_logit_softcap: float = 0.0
    num_experts: int = 0  # 0: a dense MLP
    num_experts_per_tok: int = 0

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not an HF model folder: config.json is missing")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> ModelConfig:
        c = text_config(c)  # a multimodal checkpoint's decoder (proto/multimodal.py)
        architecture = architecture_of(c)
        model_type = c.get("model_type", "")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rope_scaling=rope if rope_type == "llama3" else None,
            rotary_dim=int(head_dim * partial),
            qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            layer_windows=layer_windows(c),
            hidden_act=act,
            attention_scale=float(c.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            attn_logit_softcap=float(c.get("attn_logit_softcapping") or 0.0),
            final_logit_softcap=float(c.get("final_logit_softcapping") or 0.0),
            num_experts=int(c.get("num_local_experts") or 0),
            num_experts_per_tok=int(c.get("num_experts_per_tok") or 0),
        )

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings


def layer_windows(c: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as HF's models decide it: `layer_types` when the config
    lists them; else Gemma 2 alternates (even layers slide), Qwen slides from `max_window_layers` on when
    `use_sliding_window`, and the others (Mistral, Mixtral, Phi-3) slide on every layer when a window is set."""
    n = c["num_hidden_layers"]
    window = int(c.get("sliding_window") or 0)
    types = c.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n}")
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    if not window:
        return (0,) * n
    model_type = c.get("model_type")
    if model_type == "gemma2":
        return tuple(window if i % 2 == 0 else 0 for i in range(n))
    if model_type in _QWEN_TYPES:
        first = c.get("max_window_layers", n) if c.get("use_sliding_window", False) else n
        return tuple(window if i >= first else 0 for i in range(n))
    return (window,) * n
