"""Tiny random Llama-family models built on the fly (sharing SmolLM2's tokenizer), and the HF reference check."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model(kind: str, folder: Path, tokenizer_dir: Path, num_kv_heads: int = 2) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,  # 1: fewer KV heads than tensor-parallel ranks
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0))
        with torch.no_grad():  # random qkv biases, so a loader that drops them fails the check
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=4096))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # a larger spread than the default init, so argmax ties are rare
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's logits; a bf16/fp16 model's last hidden states are scored in float32, as our LM head scores its
    top candidates: logits rounded to bf16 move in steps of 1/16 at 8-16, coarser than the bf16 tolerance."""
    if hf_model.dtype == torch.float32:
        return hf_model(ids).logits
    hidden = hf_model.model(ids).last_hidden_state
    head = hf_model.get_output_embeddings()
    bias = None if head.bias is None else head.bias.float()
    return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)


@torch.inference_mode()
def assert_teacher_forced(hf_model, prompt: list[int], output: list[int], tol: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
    """Every generated token must be HF's greedy choice given the same prefix (within tol in logprob)."""
    logp = _hf_logits(hf_model, torch.tensor([prompt + output]))[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    gaps = logp.max(-1).values - logp.gather(1, torch.tensor(output)[:, None])[:, 0]
    bad = (gaps > tol).nonzero().flatten().tolist()
    assert not bad, f"token {bad[0]} ({output[bad[0]]}) is {float(gaps[bad[0]]):.2e} below HF's best"
