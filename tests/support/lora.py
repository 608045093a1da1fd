"""Random PEFT LoRA adapters built on the fly over a tiny model, with a nonzero B so they change the output."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def small_config() -> Any:
    """A two-layer Llama's ModelConfig (hidden 16, MLP 24, 4 heads over 2 KV heads) for LoRA layouts, no weights."""
    from worker_node.models.config import ModelConfig

    shape = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4}
    extra = {"num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "vocab_size": 32}
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, **extra})


def make_adapter(
    base: Path | Any,
    out: Path,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = ALL_MODULES,
    alpha: int = 16,
    rslora: bool = False,
    gain: float = 1.0,
) -> Path:
    """Save a PEFT adapter of `base` (a folder, or an HF model loaded from it: copied, not changed) with random A
    and B (B scaled by `gain`) into `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = _base(base) if isinstance(base, Path) else copy.deepcopy(base)
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


def make_adapters(base: Path | Any, root: Path, count: int, seed: int, rank: int = 4) -> list[Path]:
    """`count` adapters of every module: one made by PEFT, the others its copies with every tensor redrawn from the
    same spread (cheaper than PEFT `count` times)."""
    from safetensors.torch import load_file, save_file

    first = make_adapter(base, root / "a0", seed=seed, rank=rank)
    tensors = load_file(str(first / "adapter_model.safetensors"))
    paths = [first]
    for i in range(1, count):
        generator = torch.Generator().manual_seed(seed + i)
        folder = root / f"a{i}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text((first / "adapter_config.json").read_text())
        redrawn = {k: torch.randn(t.shape, generator=generator) * t.std() for k, t in tensors.items()}
        save_file(redrawn, str(folder / "adapter_model.safetensors"))
        paths.append(folder)
    return paths


def make_peft_many(base: Path, root: Path, specs: list[tuple[tuple[str, ...], int, bool]], seed: int):  # type: ignore[no-untyped-def]
    """Random adapters of (targets, rank, rslora) made by PEFT over one load of `base`, saved under `root`/"a0",
    "a1", ...; their paths and the HF + PEFT model holding them (the reference). Cheaper than
    make_adapter then load_peft_many for a real model: its weights are read once, never copied. The adapters are
    named "a0", "a1", ... (`set_adapter`), never a bare number: PEFT's save strips ".NAME" from every key, which
    would also cut a layer index ("layers.0.") out of a key of adapter "0"."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = None
    for i, (targets, rank, rslora) in enumerate(specs):
        config = LoraConfig(
            r=rank, lora_alpha=16, target_modules=list(targets), init_lora_weights=False, use_rslora=rslora
        )
        if model is None:
            model = get_peft_model(_base(base), config, adapter_name=f"a{i}")
        else:
            model.add_adapter(f"a{i}", config)
    assert model is not None, "no adapter specs"
    model.save_pretrained(str(root))  # one folder per adapter, named after it
    return [root / f"a{i}" for i in range(len(specs))], model.eval()


def load_peft_many(base: Path | Any, adapters: list[Path]):  # type: ignore[no-untyped-def]
    """One HF model holding every adapter (named "0", "1", ...): `set_adapter(str(i))` picks the reference."""
    from peft import PeftModel

    model = _base(base) if isinstance(base, Path) else copy.deepcopy(base)
    peft_model = PeftModel.from_pretrained(model, adapters[0], adapter_name="0")
    for i, path in enumerate(adapters[1:], start=1):
        peft_model.load_adapter(str(path), adapter_name=str(i))
    return peft_model.eval()


def load_peft(base: Path | Any, adapter: Path):  # type: ignore[no-untyped-def]
    """HF's model with the adapter applied (the reference); `base` as in make_adapter."""
    from peft import PeftModel

    model = _base(base) if isinstance(base, Path) else copy.deepcopy(base)
    return PeftModel.from_pretrained(model, adapter).eval()


def load_base(base: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


_base = load_base


def write_adapter(
    folder: Path,
    base: Any,
    rank: int = 4,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int | None = None,
    alpha: float = 8,
) -> Path:
    """A PEFT-shaped adapter of `base` (proto.lora.BaseShapes) written without peft or a model: zero tensors (for
    the doors' and the registry's tests, which check the adapter's shapes but never run it), or with a `seed`
    random ones that change the output."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module in modules:
            inputs, outputs = base.io(module)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            for which, shape in (("A", (rank, inputs)), ("B", (outputs, rank))):
                value = torch.zeros(shape) if generator is None else torch.randn(shape, generator=generator) * 0.3
                tensors[f"{prefix}.lora_{which}.weight"] = value
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def poison(folder: Path, which: str = "A", value: float = float("nan")) -> Path:
    """Set every lora_`which` tensor of the adapter in `folder` to `value`, in place (a file no check has seen)."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    tensors = {k: torch.full_like(t, value) if f".lora_{which}." in k else t for k, t in tensors.items()}
    save_file(tensors, str(path))
    return folder
