"""Random PEFT LoRA adapters built on the fly over a tiny model, with a nonzero B so they change the output."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Path,
    out: Path,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = ALL_MODULES,
    alpha: int = 16,
    rslora: bool = False,
    gain: float = 1.0,
) -> Path:
    """Save a PEFT adapter of `base` with random A and B (scaled by `gain`) into `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = _base(base)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(gain)
    peft_model.save_pretrained(str(out))
    return out


def load_peft(base: Path, adapter: Path):  # type: ignore[no-untyped-def]
    """HF's model with the adapter applied (the reference)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(base), adapter).eval()


def _base(base: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
