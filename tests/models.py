"""Tiny random Llama-family models built on the fly (sharing SmolLM2's tokenizer), and the HF reference check."""

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


# Tiny models built on demand by name: a kind of tests/models.py, with config overrides for named variants.
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
def hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's float32 log-probabilities `[len(output), vocab]` of each generated position, given the same prefix."""
    return _hf_logits(hf_model, torch.tensor([prompt + output]))[0, len(prompt) - 1 : -1].float().log_softmax(-1)


def teacher_forced_gaps(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Per generated token: HF's best logprob minus the token's own, given the same prefix (0: HF's greedy choice)."""
    logp = hf_logprobs(hf_model, prompt, output)
    return logp.max(-1).values - logp.gather(1, torch.tensor(output)[:, None])[:, 0]


def assert_teacher_forced(hf_model, prompt: list[int], output: list[int], tol: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
    """Every generated token must be HF's greedy choice given the same prefix (within tol in logprob)."""
    gaps = teacher_forced_gaps(hf_model, prompt, output)
    bad = (gaps > tol).nonzero().flatten().tolist()
    assert not bad, f"token {bad[0]} ({output[bad[0]]}) is {float(gaps[bad[0]]):.2e} below HF's best"


@torch.inference_mode()
def assert_same_logprobs(hf_model, runner, tokens: list[int], tol: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
    """Our log-probabilities over the whole vocabulary at every position of `tokens` (one prefill through a
    TP 1 runner's model and cache) are HF's within `tol`: this sees what greedy tokens cannot, such as a
    monotonic soft-cap on the logits."""
    from worker_node.attention import AttentionMetadata

    n, int32 = len(tokens), torch.int32
    table = torch.arange(-(-n // runner.block_size), dtype=int32)[None]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode_tokens=0,
        decode_block_tables=table[:0],
        decode_seq_lens=torch.zeros(0, dtype=int32),
        prefill_block_tables=table,
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=int32),
        prefill_seq_lens=torch.tensor([n], dtype=int32),
    )
    hidden = runner.model(torch.tensor(tokens), torch.arange(n), runner.kv_cache, meta)
    ours = runner.model.logits(hidden).log_softmax(-1)
    theirs = hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    gap = float((ours - theirs).abs().max())
    assert gap < tol, f"log-probabilities differ from HF's by up to {gap:.2e}"
