"""What an attention backend is: three operations over the paged KV cache (the signatures of
`kernels.torch_attention`), implemented by the torch reference, the C CPU kernel and the Triton kernels.

A quantized cache (int8 or fp8 values, kernels/kv_quant.py) comes with its scales as the keyword arguments
`k_scales` and `v_scales` (`[num_blocks, block_size, Hkv]` float32), passed only when the cache is quantized: a
backend written without them still runs every full-precision cache, and one that cannot read a quantized cache
is refused when the worker starts (`kernels.backend.check_reads_quantized`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class WriteKV(Protocol):
    """`kernels.torch_attention.write_kv`'s signature: the new tokens' keys and values into their slots (and, for a
    quantized cache, each token's scales into the same slots of `k_scales`/`v_scales`)."""

    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None: ...


class DecodeAttention(Protocol):
    """`kernels.torch_attention.paged_decode_attention`'s signature. `window` (a sliding window: each query sees
    its last `window` tokens, itself included) and `softcap` (scores become softcap * tanh(scores / softcap))
    are optional: 0 means none. `k_scales`/`v_scales`: a quantized cache's scales; None for full precision."""

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
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PrefillAttention(Protocol):
    """`kernels.torch_attention.paged_prefill_attention`'s signature; the keywords as for decode. The new tokens'
    own keys and values (`k`, `v`) are full precision; only the cached prefix is read from the (quantized) cache."""

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
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PlanDecode(Protocol):
    """Work a decode backend does once per step instead of once per layer (the torch reference: which blocks each
    sequence holds); the runner keeps its result in the step's metadata and passes it to every layer's
    `decode_attention` as `plan=`."""

    def __call__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> Any: ...


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The three attention operations; signatures are those of `kernels.torch_attention`. With `plan_decode`,
    `decode_attention` also takes its result as the keyword `plan`. `cache_dtypes`: the KV cache dtypes the
    operations read, when not every one (a compiled kernel's ABI is float32): the worker refuses others at start."""

    name: str
    write_kv: WriteKV
    decode_attention: DecodeAttention
    prefill_attention: PrefillAttention
    plan_decode: PlanDecode | None = None
    cache_dtypes: tuple[torch.dtype, ...] = ()  # empty: any
