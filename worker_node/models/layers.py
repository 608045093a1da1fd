"""Building blocks shared by every decoder, written against tensor parallelism.

QKV and gate/up are column-parallel (each TP rank holds its heads and its slice of the MLP), O and down are
row-parallel followed by an all-reduce, the embedding and the LM head are vocab-parallel. With one worker every
collective is a no-op and each block is the plain one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_argmax, cpu_gemm, cpu_gemm_portable, cpu_glue
from kernels.interface import AttentionBackend
from proto.parallel import kv_head_range, shard, vocab_shard
from worker_node.kv.cache import LayerKV
from worker_node.models.attention import AttentionMetadata, paged_attention
from worker_node.models.config import ModelConfig
from worker_node.runtime.parallel import Comm, ParallelRank

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class Linear(nn.Linear):
    """`nn.Linear` whose decode-sized bf16 products on CPU run in kernels/cpu_gemm.py's AMX kernel (torch's
    bf16 matmul reads the weights at a fraction of memory speed at a few rows, and leaves the second core idle).

    `invariant` (set by `set_batch_invariant`): each row's result independent of the other rows of the call."""

    invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.weight, self.bias, self.invariant)

    def native_gemm(self, rows: int, silu_gated: bool = False) -> cpu_gemm.NativeGemm | None:
        """The kernel call `forward` makes for `rows` bf16 rows on CPU (none with a bias, or fused with silu)."""
        if silu_gated or self.bias is not None or self.weight.dtype != torch.bfloat16:
            return None
        return cpu_gemm.native_linear(self.weight, rows)


def set_batch_invariant(model: nn.Module, on: bool) -> None:
    """Make every dense product of `model` (its `Linear`s and LM head) batch-invariant, or not: a sequence's
    logits then do not depend on what shares its batch (kernels/cpu_gemm.py's `linear`, `invariant`)."""
    for module in model.modules():
        if isinstance(module, (Linear, ParallelLMHead)):
            module.invariant = on


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling:  # llama3: long wavelengths scaled down, short kept, a smooth ramp between
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(medium, scaled, inv_freq)
    return inv_freq


RopeAngles = tuple[torch.Tensor, torch.Tensor]


class Rotary(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """cos/sin of every token's position, looked up once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of each head (all of them unless the RoPE is partial)."""
    cos, sin = angles
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, kept = x[..., :width], x[..., width:]
    return torch.cat([rotated * cos + _rotate_half(rotated) * sin, kept], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Gemma stores `weight - 1` (`offset=1`) and normalises in float32, as HF does.

    On CPU one pass of kernels/cpu_glue.py's kernel, on a GPU one launch of kernels/triton_norm.py's (where Triton
    imports; else torch's ops); `add` also folds in the residual add before it."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps, self.offset)[0]

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta): a sub-block's output added to the residual stream, and the next
        sub-block's input (delta None: x's norm, and x). x is the float32 residual stream (decoder.py's
        `residual_stream`); the norm comes out in the weight's dtype, the model's."""
        return _rms_norm(x, self.weight, self.eps, self.offset, delta)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm on x's device: Triton's kernel on a GPU where it reads x (else torch's ops), the C glue's on CPU."""
    triton_norm = _triton_norm() if x.is_cuda else None
    if triton_norm is not None and triton_norm.reads(x, weight, delta):
        return triton_norm.add_rms_norm(x, weight, eps, offset, delta)  # type: ignore[no-any-return]
    return cpu_glue.rms_norm(x, weight, eps, offset, delta)


@functools.cache
def _triton_norm() -> ModuleType | None:
    """kernels/triton_norm.py where Triton imports, else None (torch's ops then)."""
    try:
        from kernels import triton_norm
    except ImportError:
        return None
    return triton_norm


class Attention(nn.Module):
    """This TP rank's query heads and the KV heads they read (split, or one replicated when T > Hkv).

    `qk_norm`: an RMSNorm over each head's query and key before RoPE (Qwen3)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        backend: AttentionBackend,
        where: ParallelRank,
        comm: Comm,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        q0, q1 = shard(config.num_heads, where.tp_size, where.tp_rank)
        kv0, kv1 = kv_head_range(config.num_kv_heads, where.tp_size, where.tp_rank)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, kv1 - kv0, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)  # row-parallel
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.window = config.layer_windows[layer]
        self.softcap = config.attn_logit_softcap
        self.backend = backend
        self.comm = comm

    def forward(
        self,
        x: torch.Tensor,
        angles: RopeAngles,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not cpu_glue.rotary_(q, k, *angles):  # in place, on CPU; elsewhere torch's ops
            q, k = apply_rope(q, angles), apply_rope(k, angles)
        out = paged_attention(self.backend, q, k, v, kv_cache, meta, self.scale, self.window, self.softcap)
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate/up fused and column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, where: ParallelRank, comm: Comm) -> None:
        super().__init__()
        self.inter = config.intermediate_size // where.tp_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)  # column-parallel
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)  # row-parallel
        self.act = ACTIVATIONS[config.hidden_act]
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:
            out = silu_gated_product(self.down_proj, gate_up)
            if out is None:
                out = self.down_proj(cpu_glue.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        return self.comm.all_reduce(out)


def silu_gated_product(down: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
    """down(silu(gate) * up) in one kernel call where down's weight format has one for these inputs (int8 on
    AMX-INT8: quant_int8.py's `forward_silu_gated`); None elsewhere, and where a hook watches down (a LoRA
    adapter adds its own product to down's output through one)."""
    fused = getattr(getattr(down, "method", None), "forward_silu_gated", None)
    if fused is None or down._forward_hooks or down._forward_pre_hooks:
        return None
    out: torch.Tensor | None = fused(down, gate_up)
    return out


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds ceil(V / T) vocab rows; tokens outside them embed to zero, the all-reduce fills in.

    `scale` multiplies the embeddings (Gemma: sqrt(hidden), rounded to the model's dtype as HF does)."""

    def __init__(self, vocab_size: int, hidden_size: int, where: ParallelRank, comm: Comm, scale: float = 1.0):
        super().__init__()
        self.start, end = vocab_shard(vocab_size, where.tp_size, where.tp_rank)
        self.weight = nn.Parameter(torch.empty(end - self.start, hidden_size))
        self.sharded = where.tp_size > 1
        self.scale = scale
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            x = F.embedding(ids, self.weight)
        else:
            local = ids - self.start
            outside = (local < 0) | (local >= self.weight.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
            x = self.comm.all_reduce(x)
        return x if self.scale == 1.0 else x * torch.tensor(self.scale, dtype=x.dtype)


class ParallelLMHead(nn.Module):
    """Each TP rank scores its vocab rows; TP rank 0 gathers the full logits (the others get None).

    `softcap`: logits become cap * tanh(logits / cap) (Gemma 2's final soft-capping); 0 leaves them.
    A bf16 head on CPU scores in the AMX kernel with float32 results (kernels/cpu_gemm.py `scores`); elsewhere a
    bf16 product's rounded logits have their top candidates rescored (`rescore_top_logits`).
    `int8` (set by worker_node/models/quantize.py's `quantize_head` for `--quantization int8` on CPUs where a C
    int8 kernel runs): int8 codes of this rank's rows and their float32 scales. The head then scores every row
    from the codes (half the bytes of bf16, a quarter of float32's: at decode sizes the head reads its weight from
    memory) and rescores each row's top
    `RESCORED_INT8_LOGITS` exactly from the model-dtype weight, which stays (the tied embedding reads it): the
    argmax and the sampled top candidates are the unquantized head's; the others carry int8's rounding."""

    def __init__(self, vocab_size: int, hidden_size: int, where: ParallelRank, comm: Comm, softcap: float = 0.0):
        super().__init__()
        self.vocab_size = vocab_size
        start, end = vocab_shard(vocab_size, where.tp_size, where.tp_rank)
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))
        self.softcap = softcap
        self.comm = comm
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None

    invariant = False  # `set_batch_invariant`

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = self._int8_scores(hidden)
        if local is not None:
            local = rescore_top_logits(local, hidden, self.weight, RESCORED_INT8_LOGITS)
        elif (local := cpu_gemm.scores(hidden, self.weight)) is None:
            local = cpu_gemm.linear(hidden, self.weight, invariant=self.invariant)
            if local.dtype != torch.float32:
                local = rescore_top_logits(local, hidden, self.weight)
        logits = self.comm.gather_to_first(local)
        if logits is None:
            return None
        logits = logits[:, : self.vocab_size].float()
        return logits if not self.softcap else torch.tanh(logits / self.softcap) * self.softcap

    def _int8_scores(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """This rank's logits from the int8 codes, or None (no codes, or no kernel covers hidden)."""
        if self.int8 is None:
            return None
        return cpu_gemm_portable.scores(hidden, *self.int8)


RESCORED_LOGITS = 8
# An int8 logit is off by up to about 1 % of the row's scale: more candidates, so that the exact best is among them.
RESCORED_INT8_LOGITS = 16


def rescore_top_logits(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, count: int = RESCORED_LOGITS
) -> torch.Tensor:
    """Float32 logits whose top candidates are recomputed in float32 from the same bf16/fp16 operands.

    A bf16 logit is rounded to a step of 1/16 to 1/8 at the magnitudes of a model's best tokens (8 to 32), so
    near-ties would resolve by token id instead of by score; the top few of each row (each TP rank's own vocab
    rows, whose union holds the global top) are cheap to score exactly, the rest keep their rounded values.
    `weight`: this rank's vocab rows of the head (an int8 head's: the weight it was made from). On CPU one C pass
    scores the candidates from the weight's rows where they lie (kernels/cpu_argmax.py `rescore_rows`); else
    torch gathers them first.
    """
    top = top_candidates(logits, min(count, logits.shape[-1]))  # [B, k]
    scores = logits.float()
    if cpu_argmax.rescore_rows(scores, hidden, weight, top):
        return scores
    exact = torch.einsum("bd,bkd->bk", hidden.float(), weight[top].float())
    return scores.scatter_(1, top, exact)


CANDIDATE_CHUNK = 256


def top_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest values ([B, k], in no particular order; of tied values, any).

    torch's topk over a 49,152-token vocab took 6.8 ms at 64 rows (one thread): as long as the LM head's own
    int8 product. Cut into chunks of CANDIDATE_CHUNK, the k largest values lie in the k chunks of largest maxima (a
    value among them in any other chunk would have k chunk maxima, each in a different chunk, above it), so one
    max per chunk, a topk over the maxima and one over k chunks find them: 2.5 ms at 64 rows. The same in one C pass
    (kernels/cpu_argmax.py `top_rows`) where it builds, two threads: k = 16 of float32 rows (int8's head) 0.08 ms at
    16 rows against this path's 0.20, 0.43 at 64 against 0.88; k = 8 of bf16 rows 0.07 / 0.29 against 0.30 / 1.05."""
    top = cpu_argmax.top_rows(logits, k)
    if top is not None:
        return top
    rows, width = logits.shape
    chunks = width // CANDIDATE_CHUNK
    if width % CANDIDATE_CHUNK or chunks <= k or not logits.is_contiguous():
        return logits.topk(k, dim=-1).indices
    blocks = logits.view(rows, chunks, CANDIDATE_CHUNK)
    best_chunks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [B, k]
    candidates = blocks.gather(1, best_chunks.unsqueeze(-1).expand(rows, k, CANDIDATE_CHUNK))
    within = candidates.reshape(rows, k * CANDIDATE_CHUNK).topk(k, dim=-1).indices
    return best_chunks.gather(1, within // CANDIDATE_CHUNK) * CANDIDATE_CHUNK + within % CANDIDATE_CHUNK
