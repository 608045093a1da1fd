"""The part of an HF config.json that a Llama-family model needs, checked once at load."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not an HF model folder: config.json is missing")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> ModelConfig:
        model_type = c.get("model_type", "")
        if model_type not in SUPPORTED:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")
        heads = c["num_attention_heads"]
        window = c.get("sliding_window") if c.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rope_scaling=rope if rope_type == "llama3" else None,
            qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            sliding_window=window,
        )

    @property
    def max_model_len(self) -> int:
        """Sliding-window attention is not implemented, so contexts stay inside the window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
