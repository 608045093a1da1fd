"""A CPU decode step's decoder layers in one C call (kernels/cpu_decode_layers.py), where model and step qualify.

A Llama-family layer on CPU is a chain of C kernels called from Python: on SmolLM2 at 16 sequences, ~40 % of a
decode step's time went to the Python between them (module calls, views, checks, ctypes conversions), not to
the kernels. `NativeDecode` asks each projection which kernel call its own `forward` makes for the step's rows
(`native_gemm`, the one place that decision lives) and hands those calls, with the glue and attention kernels the
layers would call, to C: the same calls in the same order, so the hidden states are the Python path's bit for
bit (tests/worker_node/models/test_native_decode.py compares them).

It takes a model of plain Llama-family layers on one TP rank whose every projection has such a call (bf16,
int8, fp8 or AWQ weights on an x86 CPU with AMX, AVX-512 BF16 or AVX2: kernels/cpu_isa.py; no bias, LoRA hook, QK
norm, sliding window or soft-cap), and a step of decode
tokens only (at most 64, the matmul kernels' rows) over a bf16 cache read by the native attention kernel. Anything
else runs the Python layers, as before.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_attention, cpu_decode_layers, cpu_gemm, cpu_gemm_awq, cpu_glue
from kernels.cpu_decode_layers import Gemm, Kernels, Layer, Step
from kernels.cpu_gemm import NativeGemm
from worker_node.kv.cache import LayerKV
from worker_node.models.attention import AttentionMetadata
from worker_node.models.layers import Attention, RopeAngles

MAX_ROWS = min(cpu_gemm.MAX_ROWS, cpu_gemm_awq.MAX_ROWS)  # rows the matmul kernels take in one call
_profiled: weakref.WeakSet[NativeDecode] = weakref.WeakSet()


def phase_seconds() -> torch.Tensor:
    """Seconds per phase of a layer (float64 [len(PHASES)]) that the runners made with `time_phases` (a worker's
    --decode-phases) and still alive have added up, every layer and step together."""
    total = torch.zeros(len(cpu_decode_layers.PHASES), dtype=torch.float64)
    for runner in list(_profiled):
        if runner.phase_seconds is not None:
            total += runner.phase_seconds
    return total


class NativeDecode:
    """The layers' C tables, built once; `run` one step."""

    def __init__(
        self, layers: Sequence[Any], tables: list[tuple[NativeGemm, ...]], glue: ctypes.CDLL, time_phases: bool = False
    ) -> None:
        first: Attention = layers[0].self_attn
        attention = first.backend.decode_attention
        assert isinstance(attention, cpu_attention.NativeDecodeAttention)  # _plain checked it
        self.attention = attention
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale, self.eps = first.scale, layers[0].input_layernorm.eps
        self.inter = layers[0].mlp.inter
        self.hidden = layers[0].input_layernorm.weight.shape[0]
        self.probe = torch.empty(0, self.heads, self.head_dim, dtype=torch.bfloat16)  # asks the attention kernel
        self.watched = [m for layer in layers for m in layer.modules()]  # a hook added later (LoRA) opts out
        self.layers = (Layer * len(layers))()
        for row, layer, gemms in zip(self.layers, layers, tables):
            row.input_norm = layer.input_layernorm.weight.data_ptr()
            row.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, native in zip(("qkv", "o", "gate_up", "down"), gemms):
                setattr(row, name, Gemm(*native))
        runner = cpu_decode_layers.load()
        assert runner is not None  # build checked it
        self.runner = runner
        # A float64 tensor [len(PHASES)] to add each step's seconds per phase of a layer to (a profile), or None.
        self.phase_seconds: torch.Tensor | None = None
        if time_phases:  # each step's seconds per phase of a layer (cpu_decode_layers.PHASES); two clock reads each
            self.phase_seconds = torch.zeros(len(cpu_decode_layers.PHASES), dtype=torch.float64)
            _profiled.add(self)
        self.kernels = Kernels(
            *(cpu_gemm.address(glue, name) for name in ("add_rms_norm_f32", "rotary", "silu_mul", "write_kv")), None
        )

    @classmethod
    def build(cls, layers: nn.ModuleList, tp_size: int, time_phases: bool = False) -> NativeDecode | None:
        """The runner for these layers, or None where they do not qualify (see the module's docstring)."""
        glue = cpu_glue.load(torch.bfloat16)
        if tp_size != 1 or not len(layers) or glue is None or cpu_decode_layers.load() is None:
            return None
        tables, plain = [], []
        layer: Any  # a LlamaDecoderLayer (llama.py imports the decoder, which imports this module)
        for layer in layers:
            # Only a class that says so itself (not a subclass, whose forward may differ): llama.py's layer.
            if not type(layer).__dict__.get("runs_natively") or not _plain(layer):
                return None
            plain.append(layer)
            attn, mlp = layer.self_attn, layer.mlp
            down = mlp.down_proj.native_gemm(1, silu_gated=True) or mlp.down_proj.native_gemm(1)
            gemms = (attn.qkv_proj.native_gemm(1), attn.o_proj.native_gemm(1), mlp.gate_up_proj.native_gemm(1), down)
            if any(g is None for g in gemms):
                return None
            tables.append(tuple(g for g in gemms if g is not None))
        return cls(plain, tables, glue, time_phases)

    def run(
        self, x: torch.Tensor, angles: RopeAngles, kv_caches: list[LayerKV], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residual stream, last MLP output) after every layer, as the Python layers return them; None when the
        step does not qualify (nothing done). x: the float32 residual stream's start (decoder.py)."""
        rows = x.shape[0]
        cos, sin = angles
        plan = meta.decode_plan
        if not (
            0 < rows <= MAX_ROWS
            and meta.compact is None
            and meta.num_decode_tokens == rows
            and isinstance(plan, cpu_attention.NativePlan)
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.is_contiguous()
            and cos.dtype == sin.dtype == torch.bfloat16
            and cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == sin.shape
            and cos.numel() == rows * cos.shape[-1]
            and meta.slot_mapping.dtype == torch.int64
            and meta.slot_mapping.is_contiguous()
            and meta.slot_mapping.shape == (rows,)
            and len(kv_caches) == len(self.layers)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in self.watched)
        ):
            return None
        first = kv_caches[0]
        if first.k.dtype != torch.bfloat16 or not _same_layout(kv_caches, first.k):
            return None
        library = self.attention.library(self.probe, first.k, first.v, ())
        if library is None:
            return None
        self.kernels.attention = cpu_gemm.address(library, "paged_decode_attention")
        for row, cache in zip(self.layers, kv_caches):
            row.k_cache, row.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bf16 = functools.partial(torch.empty, dtype=torch.bfloat16)
        buffers = {
            "residual": torch.empty_like(x),
            "delta": bf16(rows, self.hidden),
            "h": bf16(rows, self.hidden),
            "qkv": bf16(rows, q_size + 2 * kv_size),
            "q": bf16(rows, q_size),
            "attn": bf16(rows, q_size),
            "gate_up": bf16(rows, 2 * self.inter),
            "act": bf16(rows, self.inter),
        }
        k = first.k
        step = Step(
            rows, self.hidden, self.heads, self.kv_heads, self.head_dim, cos.shape[-1], self.inter,
            self.eps, self.scale, cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
            k.shape[0] * k.shape[1], k.shape[1], plan.block_tables.shape[1],
            plan.block_tables.data_ptr(), plan.seq_lens.data_ptr(), x.data_ptr(),
            *(buffers[name].data_ptr() for name in ("residual", "delta", "h", "qkv", "q", "attn", "gate_up", "act")),
            torch.get_num_threads(), None if self.phase_seconds is None else self.phase_seconds.data_ptr(),
        )  # fmt: skip
        status = self.runner.run_decode_layers(
            ctypes.byref(self.kernels), self.layers, len(self.layers), ctypes.byref(step)
        )
        if status == -1:
            raise IndexError(f"write_kv: a slot of {meta.slot_mapping.tolist()} is outside the cache")
        if status:
            part = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")[(status - 1) % 4]
            raise RuntimeError(f"layer {(status - 1) // 4}'s {part} kernel refused a call it had accepted")
        return buffers["residual"], buffers["delta"]


def _plain(layer: Any) -> bool:
    """A Llama layer as decode_layers_cpu.c runs it: no QK norm, window, soft-cap or bias; silu; norms without
    offset and of one epsilon."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        attn.q_norm is None
        and not attn.window
        and not attn.softcap
        and mlp.act is F.silu
        and isinstance(attn.backend.decode_attention, cpu_attention.NativeDecodeAttention)
        and attn.backend.write_kv is cpu_glue.write_kv
        and all(n.offset == 0 and n.eps == norms[0].eps and _bf16_vector(n.weight) for n in norms)
    )


def _bf16_vector(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()


def _same_layout(kv_caches: list[LayerKV], k: torch.Tensor) -> bool:
    """Every layer's cache: bf16, contiguous, of the first one's shape, full precision."""
    return all(
        c.k_scales is None
        and c.k.shape == c.v.shape == k.shape
        and c.k.dtype == c.v.dtype == k.dtype
        and c.k.is_contiguous()
        and c.v.is_contiguous()
        for c in kv_caches
    )
