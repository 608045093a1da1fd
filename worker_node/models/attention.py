"""Per-step attention metadata, built once by the model runner and passed to every attention layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.interface import AttentionBackend
from kernels.kv_quant import is_quantized
from worker_node.kv.cache import LayerKV


@dataclass(slots=True)
class AttentionMetadata:
    """Tokens are laid out decodes first (one query each), then prefill chunks."""

    slot_mapping: torch.Tensor  # [T] int64: the cache slot each new token's K/V goes to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [B, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [B] int32
    prefill_block_tables: torch.Tensor  # [S, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [S + 1] int32
    prefill_seq_lens: torch.Tensor  # [S] int32
    decode_plan: Any = None  # the backend's plan_decode of the decode tables, once per step (None: it has none)
    # Per-request KV precision: the tokens from num_full_tokens on are sequences of the compact pool, described by
    # `compact` (block ids there are the compact pool's own); None when the step reads the full pool only.
    compact: AttentionMetadata | None = None
    num_full_tokens: int = 0


def paged_attention(
    backend: AttentionBackend,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # the layer's sliding window: each query sees its last `window` tokens; 0: all of them
    softcap: float = 0.0,  # scores become softcap * tanh(scores / softcap); 0: left as they are
) -> torch.Tensor:
    """Write the new tokens' K/V and attend. A batch that mixes KV formats is split by format: each part runs the
    backend on its own pool (the step's tokens are laid out full-pool sequences first)."""
    if meta.compact is None:
        return _attend(backend, q, k, v, cache, meta, scale, window, softcap)
    if cache.compact is None:
        raise RuntimeError("the step reads compact KV blocks but this worker has no compact pool")
    t = meta.num_full_tokens
    compact = _attend(backend, q[t:], k[t:], v[t:], cache.compact, meta.compact, scale, window, softcap)
    if not t:
        return compact
    return torch.cat([_attend(backend, q[:t], k[:t], v[:t], cache, meta, scale, window, softcap), compact])


def _attend(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    # A full-precision cache in another float than the model's (--kv-cache-dtype float16 under a bfloat16 model):
    # every backend reads queries and keys of one dtype, so the step runs in the cache's and its output is cast back.
    dtype = q.dtype
    if cache.k.dtype != dtype and not is_quantized(cache.k.dtype):
        q, k, v = q.to(cache.k.dtype), k.to(cache.k.dtype), v.to(cache.k.dtype)
    # The scales go only to a quantized cache's backend, so one written without them still reads full precision.
    scales = cache.scale_options()
    backend.write_kv(k, v, cache.k, cache.v, meta.slot_mapping, **scales)
    # Passed only when set, so a backend written without these keywords still runs the models that need neither.
    options: dict[str, Any] = {"window": window, **scales} if window else dict(scales)
    if softcap:
        options["softcap"] = softcap
    nd = meta.num_decode_tokens
    parts = []
    if nd:
        parts.append(
            backend.decode_attention(
                q[:nd],
                cache.k,
                cache.v,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                **options,
                **({"plan": meta.decode_plan} if meta.decode_plan is not None else {}),
            )
        )
    if nd < q.shape[0]:
        parts.append(
            backend.prefill_attention(
                q[nd:],
                k[nd:],
                v[nd:],
                cache.k,
                cache.v,
                meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens,
                scale,
                **options,
            )
        )
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.to(dtype)
