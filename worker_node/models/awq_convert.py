"""Activation-aware 4-bit quantization (AWQ, Lin et al. 2023) of a full-precision HF folder, written in AutoAWQ's
GEMM layout (`vllm-convert --quantization awq`): the checkpoint `--quantization awq` loads (quant_awq.py).

What the search does, per decoder layer, on the activations of a calibration text run through the full-precision
model (one forward pass, the inputs of every projection recorded):

1. Scales: the projections that read one input (q/k/v after the input norm, gate/up after the post-attention
   norm, down after up) get one scale per input channel, s = mean|x|^a / mean|w|^(1-a) (normalised), a searched
   over a grid of `GRID` points in [0, 1): the one whose quantized product Q(W * s) (x / s) is closest (mean
   squared error) to W x wins. Salient channels (large activations) thus get finer steps. 1/s is folded into the
   norm's weight (or up's rows), so the full-precision function is unchanged. o_proj is scaled only where its
   input width equals v's output width (no grouped-query attention), as AutoAWQ does.
2. Clipping: for each projection but q and k, the range of each (output channel, group) is shrunk by up to half
   (`GRID` steps), keeping the shrink that best preserves that group's partial dot products on sampled tokens.
3. Round to nearest, asymmetric 4-bit, one float16 scale and zero point per group of `group` input channels.

Cost: one full-precision forward over the calibration tokens, then per layer GRID quantize-and-multiply passes per
projection group (scales) and GRID / 2 per projection (clipping), over at most `MAX_TOKENS` tokens: about 20
full-precision forwards' worth of matmuls per layer: 6.4 CPU-minutes for SmolLM2-135M's 30 layers.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.torch_quant_gemm import pack
from worker_node.models.awq_calibration import CALIBRATION_TEXT
from worker_node.models.quant_awq import GROUP_SIZES

logger = logging.getLogger(__name__)

GRID = 20
MAX_TOKENS = 1024  # calibration tokens kept (the scale search's inputs; every layer's are held at once)
CLIP_TOKENS = 256  # tokens sampled for the clipping search
NOT_CLIPPED = ("q_proj", "k_proj")  # AutoAWQ's: clipping q and k moves attention scores too much


class AwqConvertError(ValueError):
    """A model or option the AWQ conversion cannot take (the message names the option or config key)."""


def pick_group(widths: list[int], requested: int | None) -> int:
    """The group size: `requested`, or the largest of GROUP_SIZES that splits every projection's input width."""
    fits = [g for g in GROUP_SIZES if all(w % g == 0 for w in widths)]
    if requested is not None:
        if requested not in fits:
            raise AwqConvertError(f"--group-size {requested}: must be one of {sorted(fits)} for this model")
        return requested
    if not fits:
        raise AwqConvertError(f"no group size of {GROUP_SIZES} splits the projections' input widths {widths}")
    return max(fits)


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] rounded to asymmetric 4-bit per group of `group` inputs and back (float32, scales as float16)."""
    codes, zeros, scales = quantize_groups(w, group)
    return ((codes - zeros) * scales).reshape(w.shape)


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, zeros, scales), each [N, K/G, G or 1] float32: scale = (max - min) / 15 rounded to float16, zero =
    round(-min / scale) in 0..15, code = clamp(round(w / scale) + zero, 0, 15)."""
    n, k = w.shape
    grouped = w.float().reshape(n, k // group, group)
    lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    zeros = torch.round(-lo / scales).clamp(0, 15)
    codes = (torch.round(grouped / scales) + zeros).clamp(0, 15)
    return codes, zeros, scales


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], group: int) -> torch.Tensor:
    """Per input channel scales [K] for the projections `weights` ([N_i, K] each) that read `x` [T, K]."""
    w = torch.cat(weights)
    x_mean = x.abs().mean(0)
    grouped = w.abs().reshape(w.shape[0], -1, group)
    w_mean = (grouped / (grouped.amax(-1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    reference = x @ w.t()
    best, best_loss = torch.ones_like(x_mean), float("inf")
    for step in range(GRID):
        ratio = step / GRID
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = float((x @ (fake_quantize(w * s, group) / s).t() - reference).pow(2).mean())
        if loss < best_loss:
            best, best_loss = s, loss
    return best


def search_clip(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] clipped per (output channel, group) to the range that best keeps its partial dot products."""
    n, k = w.shape
    step = max(1, x.shape[0] // CLIP_TOKENS)
    xs = x[::step].reshape(-1, k // group, group).transpose(0, 1)  # [groups, T, G]
    wg = w.reshape(n, k // group, group).permute(1, 2, 0)  # [groups, G, N]
    reference = torch.bmm(xs, wg)  # [groups, T, N]
    top = w.abs().reshape(n, k // group, group).amax(-1)  # [N, groups]
    best_top, best_err = top.clone(), torch.full_like(top, float("inf"))
    for shrink in range(GRID // 2):
        limit = top * (1 - shrink / GRID)
        clipped = torch.maximum(torch.minimum(w.reshape(n, k // group, group), limit[..., None]), -limit[..., None])
        q = fake_quantize(clipped.reshape(n, k), group).reshape(n, k // group, group).permute(1, 2, 0)
        err = (torch.bmm(xs, q) - reference).pow(2).mean(1).t()  # [N, groups]
        better = err < best_err
        best_err, best_top = torch.where(better, err, best_err), torch.where(better, limit, best_top)
    lim = best_top[..., None]
    return torch.maximum(torch.minimum(w.reshape(n, k // group, group), lim), -lim).reshape(n, k)


def calibration_inputs(model: nn.Module, ids: torch.Tensor, layers: list[Any]) -> list[dict[str, torch.Tensor]]:
    """Per layer, the inputs [T, K] of q_proj, o_proj, gate_proj and down_proj over `ids` [1, T] (one fp pass)."""
    found: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        for name, module in (
            ("qkv", layer.self_attn.q_proj),
            ("o", layer.self_attn.o_proj),
            ("gate_up", layer.mlp.gate_proj),
            ("down", layer.mlp.down_proj),
        ):

            def keep(_m: nn.Module, args: tuple[torch.Tensor, ...], i: int = i, name: str = name) -> None:
                found[i][name] = args[0].reshape(-1, args[0].shape[-1]).float()

            hooks.append(module.register_forward_pre_hook(keep))
    try:
        model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return found


def scale_layer(layer: Any, inputs: dict[str, torch.Tensor], group: int) -> None:
    """Search and fold the activation-aware scales of one decoder layer (its fp function unchanged). `layer`: an
    HF Llama-family decoder layer (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, the two norms)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups: list[tuple[str, list[nn.Linear], Callable[[torch.Tensor], None]]] = [
        ("qkv", [attn.q_proj, attn.k_proj, attn.v_proj], _fold_into_weight(layer.input_layernorm)),
        ("gate_up", [mlp.gate_proj, mlp.up_proj], _fold_into_weight(layer.post_attention_layernorm)),
        ("down", [mlp.down_proj], _fold_into_rows(mlp.up_proj)),
    ]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(("o", [attn.o_proj], _fold_into_rows(attn.v_proj)))
    for name, linears, fold in groups:
        s = search_scales(inputs[name], [fc.weight.float() for fc in linears], group)
        fold(s)
        for fc in linears:
            fc.weight.data = (fc.weight.float() * s).to(fc.weight.dtype)
        inputs[name] = inputs[name] / s  # what the scaled projections now read (for the clipping search)


def _fold_into_weight(norm: Any) -> Callable[[torch.Tensor], None]:
    def fold(s: torch.Tensor) -> None:
        norm.weight.data = (norm.weight.float() / s).to(norm.weight.dtype)

    return fold


def _fold_into_rows(linear: nn.Linear) -> Callable[[torch.Tensor], None]:
    def fold(s: torch.Tensor) -> None:
        linear.weight.data = (linear.weight.float() / s[:, None]).to(linear.weight.dtype)
        if linear.bias is not None:
            linear.bias.data = (linear.bias.float() / s).to(linear.bias.dtype)

    return fold


def quantize_layer(layer: Any, inputs: dict[str, torch.Tensor], group: int) -> dict[str, torch.Tensor]:
    """The AutoAWQ tensors (qweight, qzeros, scales) of one scaled layer's projections, by projection name."""
    attn, mlp = layer.self_attn, layer.mlp
    reads = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o"}
    reads |= {"gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
    out: dict[str, torch.Tensor] = {}
    for name, source in reads.items():
        prefix = "self_attn" if source in ("qkv", "o") else "mlp"
        w = getattr(attn if prefix == "self_attn" else mlp, name).weight.float()
        if name not in NOT_CLIPPED:
            w = search_clip(inputs[source], w, group)
        out |= {f"{prefix}.{name}.{part}": t for part, t in awq_tensors(w, group).items()}
    return out


def awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's qweight, qzeros and scales of w [N, K] rounded to nearest (`quantize_groups`)."""
    codes, zeros, scales = quantize_groups(w, group)
    return {
        "qweight": pack(codes.reshape(w.shape).t().int()),
        "qzeros": pack(zeros[..., 0].t().int()),
        "scales": scales[..., 0].t().contiguous().half(),
    }


def calibration_ids(tokenizer: object, text: str, rows: int = 512) -> torch.Tensor:
    """The calibration text's token ids, at most MAX_TOKENS, as [n, rows] (rows of one length: one batch)."""
    ids = tokenizer(text)["input_ids"][:MAX_TOKENS]  # type: ignore[operator]
    if len(ids) < rows:
        raise AwqConvertError(f"--calib-file: {len(ids)} tokens; AWQ's search wants at least {rows}")
    n = len(ids) // rows
    return torch.tensor(ids[: n * rows]).reshape(n, rows)


@torch.inference_mode()
def quantize_folder(source: Path, output: Path, group: int | None = None, calib_text: str | None = None) -> Path:
    """Write `output`: `source` (an HF folder of a Llama-family model) as an AutoAWQ GEMM checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config"):
        raise AwqConvertError(f"--input {source}: already quantized (config.json quantization_config)")
    if "gemma" in str(config.get("model_type", "")):
        raise AwqConvertError(
            f"--input {source}: model_type {config['model_type']!r} (its norms add 1 to their weight)"
        )
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    layers = list(model.model.layers)
    if any(not hasattr(layer.mlp, "gate_proj") for layer in layers):
        raise AwqConvertError(f"--input {source}: AWQ conversion takes dense gated-MLP decoders (no MoE)")
    widths = sorted(
        {w for layer in layers for w in (layer.self_attn.o_proj.in_features, layer.mlp.down_proj.in_features)}
    )
    group = pick_group([model.config.hidden_size, *widths], group)
    ids = calibration_ids(AutoTokenizer.from_pretrained(source), calib_text or CALIBRATION_TEXT)
    logger.info("AWQ: %d calibration tokens, group %d, %d layers", ids.numel(), group, len(layers))
    inputs = calibration_inputs(model, ids, layers)
    quantized: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        scale_layer(layer, inputs[i], group)
        quantized |= {f"model.layers.{i}.{k}": v for k, v in quantize_layer(layer, inputs[i], group).items()}
        inputs[i] = {}
        logger.info("AWQ: layer %d/%d", i + 1, len(layers))
    dtype = getattr(torch, str(config.get("torch_dtype", "float32")), torch.float32)
    kept = {}
    for name, tensor in model.state_dict().items():
        prefix = name.rsplit(".", 1)[0]
        if f"{prefix}.qweight" in quantized or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        kept[name] = tensor.to(dtype).contiguous()
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".awq-", dir=output.parent))
    try:
        for item in source.iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".index.json", ".gguf")):
                shutil.copy2(item, scratch / item.name)
        save_file(kept | quantized, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
        (scratch / "config.json").write_text(json.dumps(config, indent=2))
        scratch.chmod(0o755)  # mkdtemp's folder is private; the model folder is not
        scratch.rename(output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return output
