"""kernels/cpu_gemm.py's batch-invariant products: a row's bits depend on its own values only, whatever the call's
row count or the other rows (torch's own CPU matmul does not promise it: its algorithm changes with the row count)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm

pytestmark = pytest.mark.unit

ROWS = (1, 2, 3, 5, 16, 17, 64, 70, 130)  # a gemv, small blockings, one chunk, chunks and a padded tail, > MAX_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outputs, inputs", [(96, 64), (64, 192)])
def test_a_row_gets_the_same_bits_in_any_call(dtype: torch.dtype, outputs: int, inputs: int) -> None:
    gen = torch.Generator().manual_seed(outputs + inputs)
    w = (torch.randn(outputs, inputs, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(outputs, generator=gen).to(dtype)
    x = torch.randn(max(ROWS), inputs, generator=gen).to(dtype)
    alone = cpu_gemm.linear(x[:1], w, bias, invariant=True)[0]
    for rows in ROWS:
        others = torch.randn(rows, inputs, generator=gen).to(dtype)
        others[rows // 2] = x[0]  # the row anywhere in the call, beside other values
        out = cpu_gemm.linear(others, w, bias, invariant=True)
        assert out.shape == (rows, outputs) and out.dtype == dtype
        assert torch.equal(out[rows // 2], alone), f"{rows} rows"
    torch.testing.assert_close(alone, F.linear(x[:1], w, bias)[0], rtol=2e-2, atol=1e-2)


def test_an_empty_call_and_a_batched_input_are_torchs() -> None:
    w = torch.randn(32, 64)
    assert cpu_gemm.linear(torch.zeros(0, 64), w, invariant=True).shape == (0, 32)
    x = torch.randn(2, 3, 64)  # not a [T, K] matrix: torch's, as before
    torch.testing.assert_close(cpu_gemm.linear(x, w, invariant=True), F.linear(x, w))
