"""Per-step attention metadata, built once by the model runner and passed to every attention layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.interface import AttentionBackend
from worker_node.kv_cache import LayerKV


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
    return parts[0] if len(parts) == 1 else torch.cat(parts)
