"""GPTQ's error-compensating rounding (awq_rounding.py) on tiny shapes: codes in AWQ's range that decode with their
group's scale and zero point, plain rounding where the inputs are uncorrelated, and a smaller output error than plain
rounding where they are correlated (as a model's activations are)."""

from __future__ import annotations

import pytest
import torch

from worker_node.models.awq_convert import fake_quantize
from worker_node.models.awq_rounding import round_groups

pytestmark = pytest.mark.unit

GROUP = 16


def _decode(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (codes - zeros.repeat_interleave(GROUP, 1)) * scales.repeat_interleave(GROUP, 1)


def _correlated(tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Activations whose channels share a few directions, with a few large channels."""
    x = torch.randn(tokens, 4, generator=gen) @ torch.randn(4, k, generator=gen) + 0.3 * torch.randn(tokens, k)
    x[:, :3] *= 8
    return x


def test_codes_fill_the_awq_range_and_decode_per_group() -> None:
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 64, generator=gen), _correlated(128, 64, gen)
    codes, zeros, scales = round_groups(w, x, GROUP)
    assert codes.shape == (24, 64) and zeros.shape == scales.shape == (24, 64 // GROUP)
    assert codes.min() >= 0 and codes.max() <= 15 and zeros.min() >= 0 and zeros.max() <= 15
    assert torch.equal(codes, codes.round()) and torch.equal(zeros, zeros.round())
    assert float((_decode(codes, zeros, scales) - w).abs().mean()) < float(scales.mean())  # w, moved a little


def test_uncorrelated_inputs_round_to_nearest() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 32, generator=gen)
    x = torch.eye(32).repeat(4, 1)  # x^T x diagonal: no channel can make up for another
    torch.testing.assert_close(_decode(*round_groups(w, x, GROUP)), fake_quantize(w, GROUP))


def test_correlated_inputs_get_a_smaller_output_error_than_rounding() -> None:
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(32, 64, generator=gen), _correlated(256, 64, gen)
    reference = x @ w.t()
    gptq = float((x @ _decode(*round_groups(w, x, GROUP)).t() - reference).pow(2).mean())
    nearest = float((x @ fake_quantize(w, GROUP).t() - reference).pow(2).mean())
    assert gptq < 0.7 * nearest
