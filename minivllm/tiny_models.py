"""Tiny random models of every supported architecture, built on the fly with HF transformers and sharing SmolLM2's
tokenizer: what the tests check fidelity on, and what scripts/bench_kv_quant.py measures beside SmolLM2."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# Per kind: the HF classes and what the tiny config sets beyond COMMON, chosen so that every feature of the
# architecture changes the output (windows shorter than the test prompts, soft-caps that bite, scales that
# differ from the default).
TINY_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"rope_theta": 10000.0}),
    "qwen2": ("Qwen2", {"rope_theta": 1000000.0}),
    "mistral": ("Mistral", {"sliding_window": 4096}),
    "qwen3": ("Qwen3", {"head_dim": 32}),  # wider heads than hidden / heads, as Qwen3's own configs
    "phi3": ("Phi3", {"sliding_window": 12, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}),
    "gemma2": (
        "Gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,  # layer 0 slides, layer 1 is global
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 15.0,
        },  # untied: with tied, sqrt(hidden)-scaled embeddings each token would mostly predict itself
    ),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}

COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    eos_token_id=2,
    bos_token_id=1,
    tie_word_embeddings=False,
)


# Tiny models built on demand by name: a kind of tests/support/models.py, with config overrides for named variants.
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {}),
    "phi3": ("phi3", {}),
    "mixtral": ("mixtral", {}),
    "mistral-window": ("mistral", {"sliding_window": 16}),  # every test request generates past it
}


def build_tiny_model(kind: str, folder: Path, tokenizer_dir: Path, num_kv_heads: int = 2, **overrides: Any) -> Path:
    """A random `kind` model saved by HF itself (its own config.json and checkpoint layout)."""
    import transformers

    prefix, extra = TINY_KINDS[kind]
    config_class = getattr(transformers, f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForCausalLM")
    # num_kv_heads 1: fewer KV heads than tensor-parallel ranks
    config = config_class(**{**COMMON, "num_key_value_heads": num_kv_heads, **extra, **overrides})
    torch.manual_seed(1234)
    model = model_class(config)
    with torch.no_grad():  # a larger spread than the default init, so argmax ties are rare
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif kind == "qwen2" and name.endswith("bias"):  # random qkv biases: a loader dropping them fails
                p.normal_(0, 0.5)
            elif kind not in ("llama", "qwen2", "mistral"):  # norm weights off their init, so each one counts
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


IMAGE_TOKEN = "<image>"
TINY_IMAGE_SIZE = 28  # with 7-pixel patches: 16 patch tokens per image


def build_tiny_llava(
    folder: Path,
    tokenizer_dir: Path,
    image_size: int = TINY_IMAGE_SIZE,
    patch_size: int = 7,
    vision_hidden: int = 32,
    vision_layers: int = 3,
) -> Path:
    """A random LLaVA (CLIP vision tower, MLP projector, Llama decoder) saved by HF, with its image processor's
    preprocessor_config.json and the tiny models' tokenizer plus an `<image>` token (the vocabulary's last id).
    scripts/bench_multimodal.py builds a larger tower (224-pixel images, 256 patches) with the same function."""
    import transformers
    from tokenizers import AddedToken, Tokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_token = tokenizer.token_to_id(IMAGE_TOKEN)
    if image_token is None:
        raise RuntimeError(f"the tokenizer did not take {IMAGE_TOKEN}")
    vision = transformers.CLIPVisionConfig(
        hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=vision_layers,
        num_attention_heads=4, image_size=image_size, patch_size=patch_size, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(**{**COMMON, "vocab_size": image_token + 1, "num_key_value_heads": 2})  # type: ignore[arg-type]
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token, projector_hidden_act="gelu",
        vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1234)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():  # a larger spread than the default init, so argmax ties are rare and images matter
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    crop = {"height": image_size, "width": image_size}
    CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size=crop).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file() and name != "tokenizer.json":
            shutil.copy(tokenizer_dir / name, folder / name)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
