"""The compiled argmax against torch.argmax: ties, NaN, infinities, float32 and bfloat16, one row and many; the
compiled top-k rows (the LM head's rescoring candidates) against torch.topk's values."""

import pytest
import torch

from kernels import cpu_argmax

pytestmark = pytest.mark.unit

# Widths either side of the kernel's 32-value blocks and its short-row cut-off (64), and a vocabulary.
WIDTHS = [1, 7, 63, 64, 65, 95, 1000, 49152]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_argmax.load() is not None, "the C kernel must build on the test machines (gcc is in the set-up)"


def check(logits: torch.Tensor) -> None:
    found = cpu_argmax.checked_argmax_rows(logits)
    assert found is not None and found[0].dtype == torch.int64
    got, not_finite = found
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    maxima = logits.float().gather(1, got.unsqueeze(1)).squeeze(1)
    assert not_finite == int((~torch.isfinite(maxima)).sum()), "the count of rows whose maximum is not finite"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_random_rows(rows: int, cols: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 100003 + cols)
    check(torch.randn(rows, cols, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", WIDTHS[1:])
def test_ties_take_the_first(cols: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(cols)
    few = torch.randint(0, 3, (6, cols), generator=gen).to(dtype)  # a third of each row ties at its maximum
    same = torch.full((2, cols), 0.5, dtype=dtype)  # every value the maximum: index 0
    last = torch.zeros(2, cols, dtype=dtype)
    last[:, -2:] = 1.0  # two at the end, past the blocks: the first of them
    check(torch.cat([few, same, last]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", WIDTHS[1:])
def test_nan_and_infinities(cols: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(cols + 1)
    x = torch.randn(8, cols, generator=gen).to(dtype)
    x[0, cols // 2] = float("nan")  # NaN beats everything ...
    x[0, cols // 3] = float("inf")
    x[1, -1] = float("nan")  # ... even in the tail
    x[1, 0] = float("inf")
    x[2, :] = float("-inf")  # all -inf: the first
    x[3, cols // 2] = float("inf")
    x[3, -1] = float("inf")  # +inf twice: the first
    x[4, :] = float("nan")  # all NaN: the first
    x[5, cols // 4] = float("nan")
    x[5, cols // 2] = float("nan")  # two NaN: the first
    x[6, : cols // 2] = float("-inf")
    check(x)


def test_strided_rows_and_what_it_declines() -> None:
    """Rows apart by more than their width (a slice of columns) are read in place; other layouts, dtypes and
    devices answer None (the caller's path)."""
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(3))
    check(x[:, :250])
    check(x[::2])
    assert cpu_argmax.argmax_rows(x.t()) is None  # columns not contiguous
    assert cpu_argmax.argmax_rows(x.double()) is None
    assert cpu_argmax.argmax_rows(x[0]) is None  # one dimension
    assert cpu_argmax.argmax_rows(torch.empty(4, 0)) is None


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_shared_by_threads_answer_as_one(threads: int, dtype: torch.dtype) -> None:
    """A matrix past the kernel's parallel cut-off (1 M values): rows split between threads, ties and NaN rows
    among them, the same answers as torch whatever the thread count."""
    gen = torch.Generator().manual_seed(threads)
    logits = torch.randint(0, 4, (67, 16384), generator=gen).to(dtype)  # 1.1 M values, many ties per row
    logits[5, 9000] = float("nan")
    logits[40, 3] = float("nan")
    logits[66, -1] = 10.0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(logits)
    finally:
        torch.set_num_threads(before)


def check_top(logits: torch.Tensor, k: int) -> None:
    got = cpu_argmax.top_rows(logits, k)
    assert got is not None and got.shape == (logits.shape[0], k)
    assert all(len(set(row)) == k for row in got.tolist())  # k distinct tokens
    want = logits.float().topk(k, dim=-1).values.sort(dim=-1).values
    assert torch.equal(logits.float().gather(1, got).sort(dim=-1).values, want)  # of tied values, any


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 8, 16, 64])
def test_top_rows_hold_the_k_largest_values(threads: int, dtype: torch.dtype, k: int) -> None:
    """Rows past and below the parallel cut-off (512 K values), many ties (bf16), a row whose best values all lie
    in one chunk, a row of infinities among finite values."""
    gen = torch.Generator().manual_seed(threads * 100 + k)
    logits = (torch.randn(21, 65 * 256, generator=gen) * 4).to(dtype)
    logits[0, 256:512] = logits[0].max() + 1  # the whole row's best k in one chunk, tied
    logits[3, ::1000] = float("inf")
    logits[4, :300] = float("-inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_top(logits, k)  # 1.1 M values: rows shared by the threads
        check_top(logits[:2], k)  # one thread
    finally:
        torch.set_num_threads(before)


def test_top_rows_decline_nan_rows_and_shapes_they_do_not_cover() -> None:
    """None (the caller's torch path, which ranks NaN first) for a row with a NaN, widths not of whole 256-value
    chunks, no more chunks than k, k past 64, other dtypes and layouts."""
    x = torch.randn(3, 40 * 256, generator=torch.Generator().manual_seed(5))
    check_top(x[:, : 20 * 256], 8)  # rows apart by more than their width
    nan = x.clone()
    nan[1, 7000] = float("nan")
    assert cpu_argmax.top_rows(nan, 8) is None
    nan[1, 7000], nan[2, 3] = 0.0, float("nan")  # in a chunk's first vector
    assert cpu_argmax.top_rows(nan, 8) is None
    assert cpu_argmax.top_rows(x[:, :1000], 8) is None  # not whole chunks
    assert cpu_argmax.top_rows(x[:, : 8 * 256], 8) is None  # no more chunks than k
    assert cpu_argmax.top_rows(x, 65) is None
    assert cpu_argmax.top_rows(x.double(), 8) is None
    assert cpu_argmax.top_rows(x.t(), 8) is None
    assert cpu_argmax.top_rows(torch.empty(0, 40 * 256), 8) is None
