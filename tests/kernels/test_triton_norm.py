"""The GPU residual add + RMSNorm (kernels/triton_norm.py) in Triton's interpreter (TRITON_INTERPRET=1, conftest)
against kernels/cpu_glue.py's torch path: a float32 residual stream with a 16-bit delta and weight (every model's
stream, worker_node/models/decoder.py), a stream in the weight's dtype, no delta, Gemma's offset, widths that are no
power of two, rows that lie apart. Shapes stay tiny: the interpreter runs in Python."""

import pytest
import torch

pytest.importorskip("triton")

from kernels import cpu_glue  # noqa: E402
from kernels.triton_norm import add_rms_norm  # noqa: E402

pytestmark = pytest.mark.unit


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """One rounding of the result apart at most (float32 sums in another order)."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stream", ["float32", "model"])
@pytest.mark.parametrize(("rows", "width", "offset"), [(3, 40, 0.0), (2, 64, 1.0)])
def test_matches_the_torch_path(dtype: torch.dtype, stream: str, rows: int, width: int, offset: float) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width + 8, generator=gen) * 3)[:, :width]  # rows 8 elements apart
    x = x if stream == "float32" else x.to(dtype)
    delta = (torch.randn(rows, width, generator=gen) * 2).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    out, total = add_rms_norm(x, weight, 1e-6, offset, delta)
    want_out, want_total = cpu_glue._torch_rms_norm(x, weight, 1e-6, offset, delta)
    assert total.dtype == x.dtype
    if total.dtype == torch.bfloat16:  # the interpreter's casts to bf16 truncate; a GPU's round to nearest as torch
        _close(total, want_total)
    else:
        assert torch.equal(total, want_total), "the sum is torch's, in the stream's dtype"
    _close(out, want_out)
    alone, same = add_rms_norm(x, weight, 1e-6, offset)
    assert same is x
    _close(alone, cpu_glue._torch_rms_norm(x, weight, 1e-6, offset, None)[0])


def test_refuses_what_it_does_not_read() -> None:
    weight = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be float32 or torch.bfloat16"):
        add_rms_norm(torch.ones(2, 8, dtype=torch.float16), weight, 1e-6)
    with pytest.raises(ValueError, match="delta must be torch.bfloat16"):
        add_rms_norm(torch.ones(2, 8), weight, 1e-6, delta=torch.ones(2, 8))
