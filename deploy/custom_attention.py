"""An example of a user-written attention backend: decode attention as one padded SDPA call.

    vllm-serve --attention-backend deploy.custom_attention:PaddedDecodeAttention

The worker loads `module:Class` (the module must be importable by the worker: on PYTHONPATH or installed),
builds it without arguments and calls its three methods, which take the arguments of the functions of the same
job in `kernels/torch_attention.py` (cache layout `[num_blocks, block_size, num_kv_heads, head_dim]`),
including the keyword arguments `window` (a sliding window) and `softcap` (a score soft-cap), 0 when unused, and
`k_scales`/`v_scales`, a quantized cache's scales (`--kv-cache-dtype int8|fp8_e4m3`, kernels/kv_quant.py), passed
only when the cache is quantized: a backend without them runs full-precision caches only.

This one keeps the reference's KV write and prefill, and replaces decode: every sequence's blocks are gathered
into one `[batch, longest, ...]` tensor and a single `scaled_dot_product_attention` call masks the padding. It
is simple and exact; it pays for the copy and the padding, which the built-in kernels avoid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import torch_attention
from kernels.kv_quant import dequantize


class PaddedDecodeAttention:
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        torch_attention.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)

    def decode_attention(
        self,
        q: torch.Tensor,  # [B, H, D], one query per sequence
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        seq_lens: torch.Tensor,  # [B] int32, cached tokens including the query's own
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        k_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32, when quantized
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window or softcap:  # not this example's business: the reference handles them
            return torch_attention.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                scale,
                window=window,
                softcap=softcap,
                k_scales=k_scales,
                v_scales=v_scales,
            )
        batch, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        longest = int(seq_lens.max())
        width = -(-longest // block_size)
        blocks = block_tables[:, :width].long()  # [B, width]: padding entries point at some block, masked below
        keys = k_cache[blocks].flatten(1, 2)[:, :longest]  # [B, longest, Hkv, D]
        values = v_cache[blocks].flatten(1, 2)[:, :longest]
        if k_scales is not None and v_scales is not None:  # quantized: each token's row times its scale
            keys = dequantize(keys, k_scales[blocks].flatten(1, 2)[:, :longest])
            values = dequantize(values, v_scales[blocks].flatten(1, 2)[:, :longest])
        valid = torch.arange(longest, device=q.device)[None, :] < seq_lens[:, None]  # [B, longest]
        group = num_heads // num_kv_heads
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            keys.transpose(1, 2).repeat_interleave(group, dim=1).to(q.dtype),
            values.transpose(1, 2).repeat_interleave(group, dim=1).to(q.dtype),
            attn_mask=valid[:, None, None, :],
            scale=scale,
        )
        return out.squeeze(2)

    def prefill_attention(
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
    ) -> torch.Tensor:
        return torch_attention.paged_prefill_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens_q,
            seq_lens,
            scale,
            window=window,
            softcap=softcap,
            k_scales=k_scales,
            v_scales=v_scales,
        )
