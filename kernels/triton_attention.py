"""The Triton attention kernels behind one import, with the same signatures as `kernels.torch_attention`.

Importing this module imports triton (set `TRITON_INTERPRET=1` before the import to run on CPU).
"""

from __future__ import annotations

from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import paged_prefill_attention
from kernels.triton_write_kv import write_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]
