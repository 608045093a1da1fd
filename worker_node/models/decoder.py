"""The decoder every supported architecture shares: embed, decoder layers over a paged KV cache, norm, LM head.

A family supplies its decoder layer (and, where it differs, its norm and embedding scale). Written against
tensor and pipeline parallelism: a pipeline stage holds only its decoder layers (`layers[i]` is the
checkpoint's layer `first_layer + i`); the first stage embeds, the last one normalises and computes logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.interface import AttentionBackend
from worker_node.kv.cache import LayerKV
from worker_node.models.attention import AttentionMetadata
from worker_node.models.config import ModelConfig
from worker_node.models.layers import ParallelLMHead, RMSNorm, RopeAngles, Rotary, VocabParallelEmbedding
from worker_node.models.native_decode import NativeDecode
from worker_node.runtime.parallel import SINGLE, Comm, ParallelRank


class StepInterrupted(Exception):
    """The forward pass stopped at a layer boundary because the scheduler interrupted its step."""


class DecoderLayer(nn.Module):
    """The interface of a family's layer: the residual stream in and out, as a pair (x, delta) whose sum it is
    (delta None: x alone). The last add of a layer is left to the next one, whose first RMSNorm makes it in the
    same pass (`RMSNorm.add`), and so on to the final norm. x is float32 in every model (`residual_stream`); delta
    and everything a sub-block computes are in the model's dtype."""

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        angles: RopeAngles,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class CausalLM(nn.Module):
    embed_tokens: VocabParallelEmbedding | None
    norm: RMSNorm | None
    lm_head: ParallelLMHead | None
    norm_offset = 0.0  # Gemma's norms scale by 1 + weight

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        where: ParallelRank = SINGLE,
        comm: Comm | None = None,
    ) -> None:
        super().__init__()
        comm = comm or Comm(where)
        self.config = config
        self.where = where
        self.plan_decode = backend.plan_decode
        h, v = config.hidden_size, config.vocab_size
        embed_scale = self.embedding_scale(config)
        self.embed_tokens = VocabParallelEmbedding(v, h, where, comm, embed_scale) if where.is_first_stage else None
        self.first_layer, end = where.layout.layer_range(where.stage, config.num_layers)
        self.layers = nn.ModuleList(
            self.make_layer(config, i, backend, where, comm) for i in range(self.first_layer, end)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, self.norm_offset) if where.is_last_stage else None
        self.lm_head = ParallelLMHead(v, h, where, comm, config.final_logit_softcap) if where.is_last_stage else None
        self.tie_weights()
        self.rotary = Rotary(config, max_positions)
        self._native: NativeDecode | None = None
        self._native_checked = False
        # The worker's --native-decode and --decode-phases (settings/fast_paths.py): `use_native_decode`.
        self.native_decode, self.decode_phases = True, False

    def make_layer(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, where: ParallelRank, comm: Comm
    ) -> DecoderLayer:
        """Layer `layer` of the checkpoint (its index decides per-layer options such as a sliding window)."""
        raise NotImplementedError

    @staticmethod
    def embedding_scale(config: ModelConfig) -> float:
        return 1.0

    def tie_weights(self) -> None:
        head, embed = self.lm_head, self.embed_tokens
        if self.config.tie_word_embeddings and head is not None and embed is not None:
            head.weight = embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKV],  # this stage's layers, in order
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # [T, hidden]: the previous stage's output (not on the first)
        interrupted: Callable[[], bool] | None = None,  # asked before each layer; True raises StepInterrupted
    ) -> torch.Tensor:
        """This stage's part of the forward pass: normalised hidden states on the last stage, raw ones before."""
        if hidden is None:
            if self.embed_tokens is None:
                raise RuntimeError("a stage after the first needs the previous stage's hidden states")
            hidden = self.embed_tokens(input_ids)
        dtype = hidden.dtype
        x = residual_stream(hidden)
        angles = self.rotary(positions, dtype)
        for group in (meta, meta.compact):  # the full pool's sequences, then the compact pool's
            if self.plan_decode is not None and group is not None and group.num_decode_tokens and kv_caches:
                if group.decode_plan is None:
                    block_size = kv_caches[0].k.shape[1]  # once per step, for every layer
                    group.decode_plan = self.plan_decode(group.decode_block_tables, group.decode_seq_lens, block_size)
        delta: torch.Tensor | None = None
        native = self._native_decode()
        ran = None
        if native is not None and x.device.type == "cpu":
            if interrupted is not None and interrupted():  # the C call runs every layer: asked once
                raise StepInterrupted
            ran = native.run(x, angles, kv_caches, meta)
        if ran is not None:
            x, delta = ran
        for layer, kv_cache in zip(self.layers if ran is None else (), kv_caches):
            if interrupted is not None and interrupted():
                raise StepInterrupted
            x, delta = layer(x, delta, angles, kv_cache, meta)
        if self.norm is None:  # the next stage's input, in the model's dtype (the wire's and its buffers')
            return (x if delta is None else x + delta).to(dtype)
        return self.norm.add(x, delta)[0]

    def use_native_decode(self, on: bool, time_phases: bool = False) -> None:
        """Whether this model's CPU decode steps may run in the C runner (off: the Python layers, to compare), and
        whether that runner times its phases (native_decode.phase_seconds); before its first step."""
        self.native_decode, self.decode_phases = on, time_phases
        self._native, self._native_checked = None, False

    def _native_decode(self) -> NativeDecode | None:
        """The C runner of this stage's layers (worker_node/models/native_decode.py), made at the first step (the
        weights are in their final layout by then); None where the layers do not qualify."""
        if not self._native_checked:
            self._native_checked = True
            if self.native_decode and self.layers and _on_cpu(self):
                self._native = NativeDecode.build(self.layers, self.where.tp_size, self.decode_phases)
        return self._native

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits on the output rank; None on the other TP ranks of the last stage."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        return self.lm_head(hidden)


def residual_stream(hidden: torch.Tensor) -> torch.Tensor:
    """The residual stream's start: the embeddings (or a previous stage's output) in float32. A 16-bit model
    keeps its sub-blocks in its dtype but sums their outputs in float32: rounding the stream to bf16 after every
    add, as HF's bf16 models do, was the largest error of a bf16 forward (SmolLM2's teacher-forced logprobs:
    0.30 from float32's at worst, 0.09 kept in float32; docs/benchmarks.md). A pipeline stage hands the next one
    its output rounded to the model's dtype (the one rounding a pipeline adds)."""
    return hidden.float()


def _on_cpu(model: nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in model.parameters())
