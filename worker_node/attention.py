"""Per-step attention metadata, built once by the model runner and passed to every attention layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.interface import AttentionBackend


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


def paged_attention(
    backend: AttentionBackend,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # the layer's sliding window: each query sees its last `window` tokens; 0: all of them
    softcap: float = 0.0,  # scores become softcap * tanh(scores / softcap); 0: left as they are
) -> torch.Tensor:
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    # Passed only when set, so a backend written without these keywords still runs the models that need neither.
    options: dict[str, Any] = {"window": window} if window else {}
    if softcap:
        options["softcap"] = softcap
    nd = meta.num_decode_tokens
    parts = []
    if nd:
        parts.append(
            backend.decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                **options,
            )
        )
    if nd < q.shape[0]:
        parts.append(
            backend.prefill_attention(
                q[nd:],
                k[nd:],
                v[nd:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens,
                scale,
                **options,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
