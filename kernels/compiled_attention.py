"""An attention backend over a compiled library of the minivllm attention ABI (kernels/attention_abi.py): the
three operations of kernels/interface.py, each a call into the library with the tensors' pointers.

The library's decode attention always runs; its prefill and KV write run where it exports them, the torch
reference (kernels/torch_attention.py) where it does not, and for any call the library declines (returns
MINIVLLM_ATTENTION_DECLINED: a soft-cap it does not implement, say). Float32 caches only: `cache_dtypes` makes the
worker refuse any other at start (kernels/backend.py `check_cache_dtype`), before a step could reach a kernel.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kernels import torch_attention
from kernels.attention_abi import DECLINED, OK, AttentionLibrary
from kernels.custom_kernels import library_of
from kernels.interface import AttentionBackend
from proto.attention_setting import AttentionChoice

logger = logging.getLogger(__name__)

CACHE_DTYPES = (torch.float32,)


def compiled_backend(choice: AttentionChoice) -> AttentionBackend:
    """The backend of a compiled kernel's choice: its library (registered first when the choice names one),
    configured with the choice's params."""
    library = library_of(choice)
    library.configure_with(choice.params)
    call = _Caller(choice.type, library)
    return AttentionBackend(
        choice.type,
        CompiledWriteKV(call, library.write_kv) if library.write_kv is not None else torch_attention.write_kv,
        CompiledDecode(call),
        CompiledPrefill(call, library.prefill)
        if library.prefill is not None
        else torch_attention.paged_prefill_attention,
        cache_dtypes=CACHE_DTYPES,
    )


class _Caller:
    """What the three operations share: the library, its name, and what its return values mean."""

    def __init__(self, name: str, library: AttentionLibrary) -> None:
        self.name = name
        self.library = library
        self._declined: set[str] = set()

    def ran(self, symbol: str, code: int) -> bool:
        """True when the call did its work; False when the library declined it (logged once per function);
        RuntimeError for any other value, naming the kernel, the library, the function and the value."""
        if code == OK:
            return True
        if code == DECLINED:
            if symbol not in self._declined:
                self._declined.add(symbol)
                logger.info("attention kernel %r declined a %s call: the torch reference runs it", self.name, symbol)
            return False
        raise RuntimeError(f"attention kernel {self.name!r}: {symbol} of {self.library.path} returned {code}")

    def check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise TypeError(
                    f"attention kernel {self.name!r} takes contiguous float32 tensors (the minivllm attention ABI), "
                    f"got a {'' if t.is_contiguous() else 'non-contiguous '}{t.dtype} one of shape {tuple(t.shape)}"
                )


def _stream(t: torch.Tensor) -> int | None:
    """The current CUDA stream of `t`'s device (the library enqueues its work there); NULL on the CPU."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _no_scales(name: str, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    if k_scales is not None or v_scales is not None:  # the worker refuses quantized caches before this
        raise TypeError(f"attention kernel {name!r} reads float32 KV caches only, not a quantized one")


def _inputs(
    call: _Caller,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both attention entries hand the library: the query contiguous and checked against the caches, the block
    tables and sequence lengths as int32, and the output to fill (a quantized cache refused)."""
    _no_scales(call.name, k_scales, v_scales)
    query = q.contiguous()
    call.check(query, k_cache, v_cache)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    return query, tables, lens, torch.empty_like(query)


class CompiledDecode:
    """`minivllm_decode_attention`, with the signature of `kernels.torch_attention.paged_decode_attention`."""

    def __init__(self, call: _Caller) -> None:
        self._call = call

    def __call__(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B]
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        call = self._call
        query, tables, lens, out = _inputs(call, q, k_cache, v_cache, block_tables, seq_lens, k_scales, v_scales)
        batch, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
        code = call.library.decode(
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, num_blocks, block_size, tables.shape[1],
            scale, window, softcap, _stream(q),
        )  # fmt: skip
        if call.ran("minivllm_decode_attention", code):
            return out
        return torch_attention.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, window=window, softcap=softcap
        )


class CompiledPrefill:
    """`minivllm_prefill_attention`, with the signature of `kernels.torch_attention.paged_prefill_attention`. The
    new tokens' keys and values are read from the cache (the attention layer writes them first), so `k` and `v`
    go to the torch reference only."""

    def __init__(self, call: _Caller, function: Any) -> None:
        self._call = call
        self._function = function  # the library's, a ctypes function

    def __call__(
        self,
        q: torch.Tensor,  # [Tq, H, D]
        k: torch.Tensor,  # [Tq, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks]
        cu_seqlens_q: torch.Tensor,  # [S + 1]
        seq_lens: torch.Tensor,  # [S]
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        call = self._call
        query, tables, lens, out = _inputs(call, q, k_cache, v_cache, block_tables, seq_lens, k_scales, v_scales)
        starts = cu_seqlens_q.to(torch.int32).contiguous()
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
        code = self._function(
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(),
            lens.data_ptr(), out.data_ptr(), lens.shape[0], num_tokens, num_heads, num_kv_heads, head_dim,
            num_blocks, block_size, tables.shape[1], scale, window, softcap, _stream(q),
        )  # fmt: skip
        if call.ran("minivllm_prefill_attention", code):
            return out
        return torch_attention.paged_prefill_attention(
            q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, window=window, softcap=softcap
        )


class CompiledWriteKV:
    """`minivllm_write_kv`, with the signature of `kernels.torch_attention.write_kv`."""

    def __init__(self, call: _Caller, function: Any) -> None:
        self._call = call
        self._function = function  # the library's, a ctypes function

    def __call__(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        call = self._call
        _no_scales(call.name, k_scales, v_scales)
        keys, values = key.contiguous(), value.contiguous()
        call.check(keys, values, k_cache, v_cache)
        slots = slot_mapping.to(torch.int64).contiguous()
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        code = self._function(
            keys.data_ptr(), values.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            keys.shape[0], num_kv_heads, head_dim, num_blocks * block_size, _stream(key),
        )  # fmt: skip
        if not call.ran("minivllm_write_kv", code):
            torch_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)
