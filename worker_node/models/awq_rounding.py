"""Error-compensating rounding of 4-bit groups (GPTQ, Frantar et al. 2022), the last step of `vllm-convert
--quantization awq`: the codes it picks still fill AutoAWQ's layout (one scale and zero point per group of `group`
input channels, groups in input order), so the checkpoint is an ordinary AWQ one.

Rounding each weight to its nearest code leaves every output with the sum of independent errors. GPTQ rounds the
input channels one at a time and moves the channels not yet rounded to cancel what the rounding did to the output
on the calibration activations x: with H = x^T x / T, the error e of channel i spreads over the later channels j by
-e H^-1[i, j] / H^-1[i, i] (the upper Cholesky factor of H^-1 gives those rows), minimising |x (W - Q)^T|^2 one
channel at a time. A group's scale and zero point are set from its (updated) weights when the group is reached.

Cost per projection group: one K x K matrix from the activations and K rank-one updates of the weights [N, K], tiny
beside the scale search for SmolLM2 (K <= 1536). `DAMP` (1 % of H's mean diagonal, as the paper) keeps H
invertible when some channels never fire in the calibration text.
"""

from __future__ import annotations

import torch

DAMP = 0.01


def group_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) [N, 1] of one group of columns w [N, G]: AWQ's asymmetric range, scale rounded to float16."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    return scales, torch.round(-lo / scales).clamp(0, 15)


def inverse_factor(x: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of (x^T x / T + damping)^-1, x [T, K] the activations the weights read."""
    h = x.t() @ x / x.shape[0]
    k = h.shape[0]
    h[torch.arange(k), torch.arange(k)] += DAMP * float(h.diagonal().mean()) + 1e-8
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def round_groups(w: torch.Tensor, x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K], zeros [N, K/G], scales [N, K/G]) float32 of w [N, K] read by x [T, K], rounded by GPTQ."""
    w = w.float().clone()
    n, k = w.shape
    factor = inverse_factor(x.float())
    codes = torch.empty_like(w)
    zeros, scales = torch.empty(n, k // group), torch.empty(n, k // group)
    for start in range(0, k, group):
        end = start + group
        block, errors, f = w[:, start:end].clone(), torch.empty(n, group), factor[start:end, start:end]
        s, z = group_params(block)
        scales[:, start // group], zeros[:, start // group] = s[:, 0], z[:, 0]
        for i in range(group):
            col = block[:, i : i + 1]
            code = torch.clamp(torch.round(col / s) + z, 0, 15)
            codes[:, start + i] = code[:, 0]
            err = (col - (code - z) * s) / f[i, i]
            block[:, i:] -= err @ f[i : i + 1, i:]  # the rest of this group absorbs channel i's error
            errors[:, i : i + 1] = err
        w[:, end:] -= errors @ factor[start:end, end:]  # and the later groups, all at once
    return codes, zeros, scales
