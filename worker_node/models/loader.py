"""Load a checkpoint (safetensors shards, or a GGUF file dequantised at load) into the model its config names.

Checkpoint names are HF's. Our models fuse q/k/v and gate/up (read from separate tensors, or from checkpoints
that store them fused, as Phi-3's do) and stack each MoE layer's experts. With tensor or pipeline parallelism
each worker reads only the tensors of its stage and keeps only its slice of each: its heads of q/k/v and o,
its part of gate/up and down (of every expert), its vocab rows.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from kernels.interface import AttentionBackend
from proto.checkpoints import GGUF, weight_files
from proto.parallel import kv_head_range, shard, vocab_shard
from proto.quantization import checkpoint_quantization, resolve_quantization
from worker_node.models.config import ModelConfig
from worker_node.models.decoder import CausalLM
from worker_node.models.quant_linear import QuantMethod, TensorAxes
from worker_node.models.quantize import (
    QuantizedCheckpoint,
    after_load,
    cast_model,
    make_method,
    prepare_model,
    quant_axes,
    quantize_head,
)
from worker_node.models.registry import model_class
from worker_node.runtime.huge_pages import collapse, module_tensors
from worker_node.runtime.parallel import SINGLE, Comm, ParallelRank

logger = logging.getLogger(__name__)

_WEIGHT = TensorAxes(0, 1)  # a full-precision weight [out, in]

_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


class Checkpoint(Protocol):
    def __contains__(self, name: str) -> bool: ...

    def __getitem__(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


class SafetensorsCheckpoint:
    """The tensors of safetensors shards, read one at a time on demand (a pipeline stage reads its own)."""

    def __init__(self, files: list[Path]) -> None:
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                self._where[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"weight {name} is missing from the checkpoint")
        return self._where[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()


class TensorDict:
    """Tensors already in memory under HF names (a dequantised GGUF file)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise KeyError(f"weight {name} is missing from the checkpoint")
        return self._tensors[name]

    def close(self) -> None:
        self._tensors.clear()


def open_checkpoint(folder: Path) -> Checkpoint:
    kind, files = weight_files(folder)
    if kind == GGUF:
        from worker_node.models.gguf import read_tensors

        return TensorDict(read_tensors(files[0], folder))
    return SafetensorsCheckpoint(files)


class DecoderView:
    """A multimodal checkpoint's text decoder under a causal LM's names (`model.*`, `lm_head.*`): LLaVA stores it
    as `model.language_model.*` (transformers 5) or `language_model.model.*` and `language_model.lm_head.*`."""

    def __init__(self, hf: Checkpoint, body: str, head: str) -> None:
        self._hf, self._body, self._head = hf, body, head

    @classmethod
    def over(cls, hf: Checkpoint) -> Checkpoint:
        for body, head in (("model.language_model.", "lm_head."), ("language_model.model.", "language_model.lm_head.")):
            if f"{body}embed_tokens.weight" in hf:
                return cls(hf, body, head)
        return hf

    def _name(self, name: str) -> str:
        if name.startswith("model."):
            return self._body + name[len("model.") :]
        return self._head + name[len("lm_head.") :] if name.startswith("lm_head.") else name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self._hf

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._hf[self._name(name)]

    def close(self) -> None:
        self._hf.close()


def load_model(
    folder: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    where: ParallelRank = SINGLE,
    comm: Comm | None = None,
    quantization: str = "none",
    huge_pages: bool = True,
) -> CausalLM:
    """`quantization`: a format name (proto/quantization.py); `auto` takes the checkpoint's own. `huge_pages`: a
    CPU model's weights are collapsed onto huge pages once loaded (worker_node/runtime/huge_pages.py)."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    quantization = resolve_quantization(quantization, folder)
    stored = checkpoint_quantization(folder)
    method = make_method(quantization, device, stored) if quantization != "none" else None
    made_on_load = not stored  # a full-precision checkpoint, quantized as it loads
    where.layout.check_model(config.num_heads, config.num_kv_heads, config.intermediate_size, config.num_layers)
    with torch.device("meta"):
        model = model_class(config.architecture)(config, backend, max_positions, where, comm)
        if method is not None:
            prepare_model(model, method)
    hf: Checkpoint = DecoderView.over(open_checkpoint(folder))
    if method is not None:
        hf = QuantizedCheckpoint(hf, method, made_on_load)
    try:
        state = {name: _hf_tensor(hf, name, config, where, model.first_layer, method) for name in model.state_dict()}
    finally:
        hf.close()
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    model.rotary = model.rotary.__class__(config, max_positions)  # buffers were created on meta
    cast_model(model, device, dtype)
    model.rotary.to(dtype=torch.float32)
    after_load(model)
    quantize_head(model, method)
    model.eval()
    if device.type == "cpu" and huge_pages:
        collapse(module_tensors(model))
    logger.info(
        "loaded %s (%s, %d of %d layers, TP rank %d of %d) in %s%s",
        folder.name,
        config.architecture,
        len(model.layers),
        config.num_layers,
        where.tp_rank,
        where.tp_size,
        dtype,
        f", weights in {quantization}" if method is not None else "",
    )
    return model


def _hf_tensor(
    hf: Checkpoint,
    name: str,
    config: ModelConfig,
    where: ParallelRank,
    first_layer: int = 0,
    method: QuantMethod | None = None,
) -> torch.Tensor:
    """The checkpoint tensor behind one of our parameter names, cut to this TP rank's slice (a quantized
    tensor along the dims where its format keeps output and input channels)."""
    if name.startswith("layers."):  # a stage's local layer index -> the checkpoint's
        _, index, rest = name.split(".", 2)
        name = f"layers.{int(index) + first_layer}.{rest}"
    axes = quant_axes(method, name)
    if name == "lm_head.weight" and (config.tie_word_embeddings or name not in hf):
        return _vocab_rows(hf["model.embed_tokens.weight"], config, where)
    hf_name = name if name.startswith("lm_head") else f"model.{name}"
    if name in ("lm_head.weight", "embed_tokens.weight"):
        return _vocab_rows(hf[hf_name], config, where)
    if ".qkv_proj." in hf_name:
        return _fused(hf, hf_name, "qkv_proj", ("q_proj", "k_proj", "v_proj"), config, where, axes)
    if ".mlp.gate_up_proj." in hf_name:
        return _fused(hf, hf_name, "gate_up_proj", ("gate_proj", "up_proj"), config, where, axes)
    if ".experts." in hf_name:
        return _experts(hf, hf_name, config, where)
    tensor = hf[hf_name]
    if hf_name.rsplit(".", 1)[0].endswith(_ROW_PARALLEL):
        inputs = config.num_heads * config.head_dim if "o_proj" in hf_name else config.intermediate_size
        return _row_part(tensor, inputs, where, axes)
    return tensor


def _fused(
    hf: Checkpoint,
    hf_name: str,
    fused: str,
    parts: tuple[str, ...],
    config: ModelConfig,
    where: ParallelRank,
    axes: TensorAxes = _WEIGHT,
) -> torch.Tensor:
    """q/k/v (or gate/up) of this rank, one after the other: from separate tensors, or cut from a fused one."""
    names = [hf_name.replace(fused, part) for part in parts]
    if axes.out_dim is None:  # not per output channel (a per-tensor scale): one for the fused layer
        return hf[names[0]] if names[0] in hf else hf[hf_name]
    if names[0] in hf or hf_name not in hf:  # separate tensors (a missing one is named as the checkpoint names it)
        tensors = [hf[n] for n in names]
    else:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        sizes = [q, kv, kv] if fused == "qkv_proj" else [config.intermediate_size] * 2
        tensors = list(hf[hf_name].split([n // axes.out_pack for n in sizes], dim=axes.out_dim))
    parts_here = [_column_part(t, part, config, where, axes) for t, part in zip(tensors, parts)]
    return torch.cat(parts_here, dim=axes.out_dim)


def _experts(hf: Checkpoint, hf_name: str, config: ModelConfig, where: ParallelRank) -> torch.Tensor:
    """One stacked tensor of every expert's weights, from HF's per-expert w1 (gate), w3 (up), w2 (down)."""
    prefix, stacked = hf_name.rsplit(".", 1)
    experts = range(config.num_experts)
    if stacked == "gate_up_proj":
        return torch.stack(
            [
                torch.cat(
                    [
                        _column_part(hf[f"{prefix}.{e}.w1.weight"], "gate", config, where),
                        _column_part(hf[f"{prefix}.{e}.w3.weight"], "up", config, where),
                    ]
                )
                for e in experts
            ]
        )
    return torch.stack([_row_part(hf[f"{prefix}.{e}.w2.weight"], config.intermediate_size, where) for e in experts])


def _row_part(tensor: torch.Tensor, inputs: int, where: ParallelRank, axes: TensorAxes = _WEIGHT) -> torch.Tensor:
    """Row-parallel: a slice of the inputs (columns; a quantized tensor's input dim, none for per-row scales)."""
    if where.tp_size == 1 or axes.in_dim is None:
        return tensor
    start, end = shard(inputs, where.tp_size, where.tp_rank)
    return _channels(tensor, axes.in_dim, axes.in_pack, start, end).clone()  # a copy: the full one is freed


def _column_part(
    tensor: torch.Tensor, part: str, config: ModelConfig, where: ParallelRank, axes: TensorAxes = _WEIGHT
) -> torch.Tensor:
    """Column-parallel: this rank's output rows of q, k, v (by head) or gate, up (by MLP column); biases too."""
    if where.tp_size == 1 or axes.out_dim is None or tensor.dim() == 0:
        return tensor
    dim = axes.out_dim if tensor.dim() > 1 else 0  # a bias has only its output channels
    d = config.head_dim
    if part == "q_proj":
        start, end = shard(config.num_heads, where.tp_size, where.tp_rank)
        return _channels(tensor, dim, axes.out_pack, start * d, end * d)
    if part in ("k_proj", "v_proj"):
        start, end = kv_head_range(config.num_kv_heads, where.tp_size, where.tp_rank)
        return _channels(tensor, dim, axes.out_pack, start * d, end * d)
    start, end = shard(config.intermediate_size, where.tp_size, where.tp_rank)
    return _channels(tensor, dim, axes.out_pack, start, end)


def _channels(tensor: torch.Tensor, dim: int, pack: int, start: int, end: int) -> torch.Tensor:
    """Channels [start, end) along `dim`, where one stored element packs `pack` channels (or a group of them)."""
    if start % pack or end % pack:
        raise ValueError(f"channels {start}:{end} do not split on this format's {pack}-channel packing")
    return tensor.narrow(dim, start // pack, (end - start) // pack)


def _vocab_rows(tensor: torch.Tensor, config: ModelConfig, where: ParallelRank) -> torch.Tensor:
    """This rank's vocab rows (of a weight, or of a quantized head's rows and their scales)."""
    if where.tp_size == 1:
        return tensor
    start, end = vocab_shard(config.vocab_size, where.tp_size, where.tp_rank)
    rows = tensor[start:end].clone()
    if rows.shape[0] < end - start:  # the last rank's padding rows score 0 and are cut off after the gather
        rows = torch.cat([rows, rows.new_zeros(end - start - rows.shape[0], *rows.shape[1:])])
    return rows
