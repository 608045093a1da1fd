"""LLaVA's vision side (`model_loader.extra_modules: [vision_encoder]`): a CLIP vision tower and the MLP projector
that maps its patch features into the decoder's embedding space. An image's projected patches replace its
placeholder tokens in the prompt (worker_node/image_embeds.py); the decoder is our Llama path.

Written from HF's `CLIPVisionModel` / `LlavaMultiModalProjector` and read from their safetensors names (any of
their layouts: `vision_tower.*`, the hub's `vision_tower.vision_model.*`, `model.vision_tower.*`). The tower runs
only the layers up to `vision_feature_layer`; the `default` feature strategy drops the class token. Replicated on
every TP rank (each computes the same embeddings; the tower is small beside the decoder).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from worker_node.models.loader import Checkpoint, open_checkpoint

logger = logging.getLogger(__name__)

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}

# The checkpoint's prefixes of the tower and the projector: as transformers 5 saves them, as the hub's llava-hf
# checkpoints hold them, and transformers 5's in-memory names.
_LAYOUTS = (
    ("vision_tower.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "multi_modal_projector."),
    ("model.vision_tower.", "model.multi_modal_projector."),
)


def _activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class VisionEmbeddings(nn.Module):
    def __init__(self, hidden: int, channels: int, image_size: int, patch: int) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((image_size // patch) ** 2 + 1, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, 1 + patches, hidden]
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, eps = c["hidden_size"], c.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(h, eps=eps)
        self.self_attn = VisionAttention(h, c["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(h, eps=eps)
        self.mlp = VisionMLP(h, c["intermediate_size"], c.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """Pixel values `[B, C, H, W]` to projected patch embeddings `[B, tokens_per_image, text hidden]`."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        v = config["vision_config"]
        h = v["hidden_size"]
        self.embeddings = VisionEmbeddings(h, v.get("num_channels", 3), v.get("image_size", 224), v["patch_size"])
        self.pre_layrnorm = nn.LayerNorm(h, eps=v.get("layer_norm_eps", 1e-5))
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(feature_layers(config)))
        text_hidden = (config.get("text_config") or {}).get("hidden_size", h)
        bias = bool(config.get("multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(h, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.projector_act = _activation(config.get("projector_hidden_act", "gelu"))
        self.keep_class = config.get("vision_feature_select_strategy", "default") == "full"

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels.to(self.pre_layrnorm.weight.dtype)))
        for layer in self.layers:
            x = layer(x)
        features = x if self.keep_class else x[:, 1:]
        return self.linear_2(self.projector_act(self.linear_1(features)))

    def hf_names(self, tower: str, projector: str) -> dict[str, str]:
        """Our parameter names -> the checkpoint's."""
        out = {}
        for name in self.state_dict():
            if name.startswith(("linear_1.", "linear_2.")):
                out[name] = projector + name
            else:
                out[name] = (
                    tower + name.replace("layers.", "encoder.layers.", 1)
                    if name.startswith("layers.")
                    else tower + name
                )
        return out


def feature_layers(config: dict[str, Any]) -> int:
    """How many tower layers the features come from: HF's hidden_states[vision_feature_layer], where entry k is
    the output of k layers (entry 0 the embeddings)."""
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: only one layer is supported")
    total = int(config["vision_config"]["num_hidden_layers"])
    count = total + 1 + layer if layer < 0 else layer
    if not 0 <= count <= total:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {total} layers")
    return count


def load_vision_encoder(
    folder: str | Path, config: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> VisionEncoder:
    """The tower and projector of a LLaVA checkpoint, in `dtype` on `device` (the same on every TP rank)."""
    with torch.device("meta"):
        encoder = VisionEncoder(config)
    hf: Checkpoint = open_checkpoint(Path(folder))
    try:
        tower, projector = next(
            (layout for layout in _LAYOUTS if f"{layout[0]}embeddings.class_embedding" in hf), _LAYOUTS[0]
        )
        state = {ours: hf[theirs] for ours, theirs in encoder.hf_names(tower, projector).items()}
    finally:
        hf.close()
    encoder.load_state_dict(state, assign=True, strict=True)
    encoder.to(device=device, dtype=dtype).eval()
    logger.info("loaded the vision encoder of %s (%d tower layers + projector)", Path(folder).name, len(encoder.layers))
    return encoder
