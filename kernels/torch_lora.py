"""Each token's LoRA adapter added to a projection's output: the torch reference of kernels/triton_lora.py.

The resident adapters of one projection sit side by side in a stack (worker_node/lora/manager.py): A `[W, in]`
(each adapter's rows `starts[s] .. starts[s] + widths[s]`) and B `[out, W]` (the same columns). A token of slot `s`
gets `x A_s^T B_s^T`; a token of slot -1 (the base model) or of a slot of width 0 gets nothing:
    shrink: xa[t, :w] = x[t] @ A[starts[s] : starts[s] + w]^T            (w = widths[s], s = token_slots[t])
    expand: y[t]     = base[t] + xa[t, :w] @ B[:, starts[s] : starts[s] + w]^T
"""

from __future__ import annotations

import torch


def lora_add_reference(
    base: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    starts: torch.Tensor,
    widths: torch.Tensor,
) -> torch.Tensor:
    """`base` `[T, out]` plus each token's adapter update (a new tensor; float32 accumulation)."""
    y = base.float().clone()
    for slot in torch.unique(token_slots).tolist():
        if slot < 0 or slot >= len(widths) or int(widths[slot]) == 0:
            continue
        rows = token_slots == slot
        start, width = int(starts[slot]), int(widths[slot])
        xa = x[rows].float() @ a[start : start + width].float().t()
        y[rows] += xa @ b[:, start : start + width].float().t()
    return y.to(base.dtype)
