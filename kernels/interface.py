"""What an attention backend is: three operations over the paged KV cache (the signatures of
`kernels.torch_attention`), implemented by the torch reference, the C CPU kernel and the Triton kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class DecodeAttention(Protocol):
    """`kernels.torch_attention.paged_decode_attention`'s signature. `window` (a sliding window: each query sees
    its last `window` tokens, itself included) and `softcap` (scores become softcap * tanh(scores / softcap))
    are optional: 0 means none."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


class PrefillAttention(Protocol):
    """`kernels.torch_attention.paged_prefill_attention`'s signature; `window` and `softcap` as for decode."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The three attention operations; signatures are those of `kernels.torch_attention`."""

    name: str
    write_kv: WriteKV
    decode_attention: DecodeAttention
    prefill_attention: PrefillAttention
