"""The quantized-weight GEMMs (kernels/triton_quant_gemm.py) in Triton's interpreter (TRITON_INTERPRET=1, conftest)
against their torch references (kernels/torch_quant_gemm.py): AWQ codes in AutoAWQ's packing with zero points and
group scales, int8 rows with a scale each; row and column counts that are no multiple of the tiles, the K loop split
over programs and not. Shapes stay tiny: the interpreter runs in Python. bf16 is checked on a GPU only
(scripts/gpu_quant.py), because the interpreter's `tl.dot` multiplies raw bf16 bit patterns."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_quant_gemm  # noqa: E402
from kernels.torch_quant_gemm import awq_gemm_reference, int8_gemm_reference, pack, unpack  # noqa: E402
from kernels.triton_quant_gemm import Tiles, awq_gemm, choose_split, int8_gemm  # noqa: E402
from worker_node.models import quant_awq, quant_int8  # noqa: E402
from worker_node.models.quant_linear import QuantLinear  # noqa: E402

pytestmark = pytest.mark.unit

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3}


def _awq(k: int, n: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    return pack(codes), pack(zeros), scales


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize(
    ("dtype", "rows", "group", "split"),
    [
        (torch.float32, 1, 32, 1),
        (torch.float32, 5, 64, 2),  # two programs share the K loop, their partial sums added after
        (torch.float16, 3, 32, 3),
        (torch.float16, 20, 32, None),  # 20 rows: two 16-row tiles; the split chosen by the device
    ],
)
def test_awq_gemm_matches_the_torch_reference(dtype: torch.dtype, rows: int, group: int, split: int | None) -> None:
    k, n = 128, 40  # 40 outputs: five packed words, not a whole 64-wide tile
    qweight, qzeros, scales = _awq(k, n, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    _close(
        awq_gemm(x, qweight, qzeros, scales, group, split_k=split),
        awq_gemm_reference(x, qweight, qzeros, scales, group),
        dtype,
    )


def test_awq_gemm_reads_each_channel_from_its_own_nibble() -> None:
    """One code set per output channel at a time: a kernel that read AutoAWQ's interleaved nibbles in plain order
    would put channel 1's weight in channel 2's output."""
    k, n, group = 32, 8, 32
    for channel in range(n):
        codes = torch.zeros(k, n, dtype=torch.int64)
        codes[:, channel] = 3
        qweight, qzeros = pack(codes), pack(torch.zeros(1, n, dtype=torch.int64))
        scales = torch.ones(1, n, dtype=torch.float16)
        out = awq_gemm(torch.ones(1, k), qweight, qzeros, scales, group)
        want = torch.zeros(1, n)
        want[0, channel] = 3 * k
        assert torch.equal(out, want), channel
    assert torch.equal(unpack(pack(codes)), codes.to(torch.int32))


@pytest.mark.parametrize(
    ("dtype", "rows", "split"), [(torch.float32, 1, 1), (torch.float16, 17, 2), (torch.float16, 4, None)]
)
def test_int8_gemm_matches_the_torch_reference(dtype: torch.dtype, rows: int, split: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    k, n = 96, 70  # K not a whole number of 64-wide tiles, N not of 64-wide ones
    qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 0.001
    x = torch.randn(rows, k, generator=gen).to(dtype)
    _close(int8_gemm(x, qweight, scales, split_k=split), int8_gemm_reference(x, qweight, scales), dtype)


@pytest.mark.parametrize("tile", [Tiles(16, 32, 32, gather=True), Tiles(32, 16, 16, warps=2, stages=2)])
def test_awq_gemm_takes_other_tiles_and_the_gathered_words(tile: Tiles) -> None:
    """The tiles a sweep tries (scripts/gpu_quant.py --sweep) compute the same product: words loaded once per
    channel or widened in registers, K tiles smaller than the group."""
    qweight, qzeros, scales = _awq(64, 48, 32)
    x = torch.randn(18, 64, generator=torch.Generator().manual_seed(4))
    want = awq_gemm_reference(x, qweight, qzeros, scales, 32)
    _close(awq_gemm(x, qweight, qzeros, scales, 32, split_k=2, tile=tile), want, torch.float32)
    with pytest.raises(ValueError, match="must divide group_size"):
        awq_gemm(x, qweight, qzeros, scales, 32, tile=Tiles(16, 16, 64))


def test_no_rows_give_an_empty_product() -> None:
    qweight, qzeros, scales = _awq(64, 16, 32)
    assert awq_gemm(torch.randn(0, 64), qweight, qzeros, scales, 32).shape == (0, 16)
    assert int8_gemm(torch.randn(0, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)).shape == (0, 8)


def test_the_same_inputs_give_the_same_bits() -> None:
    qweight, qzeros, scales = _awq(128, 16, 32)
    x = torch.randn(2, 128)
    first = awq_gemm(x, qweight, qzeros, scales, 32, split_k=2)
    assert torch.equal(first, awq_gemm(x, qweight, qzeros, scales, 32, split_k=2))


def test_the_split_fills_the_device_and_keeps_whole_runs_of_k() -> None:
    cpu = torch.device("cpu")  # the interpreter's stand-in: 4 multiprocessors
    assert choose_split(cpu, output_tiles=1, k_tiles=64) == 8  # two programs per multiprocessor
    assert choose_split(cpu, output_tiles=1, k_tiles=8) == 2  # at least four K tiles each
    assert choose_split(cpu, output_tiles=16, k_tiles=64) == 1  # enough output tiles already


def test_bad_shapes_and_dtypes_are_refused_with_the_field_named() -> None:
    qweight, qzeros, scales = _awq(64, 16, 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size"):
        awq_gemm(x, qweight, qzeros, scales, 48)
    with pytest.raises(ValueError, match="qzeros must be"):
        awq_gemm(x, qweight, qzeros[:1], scales, 32)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        awq_gemm(x[:, :32], qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="x must be one of"):
        awq_gemm(x.double(), qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="int32"):
        awq_gemm(x, qweight.long(), qzeros, scales, 32)
    with pytest.raises(ValueError, match="qweight must be contiguous int8"):
        int8_gemm(x, torch.zeros(8, 64, dtype=torch.int16), torch.ones(8))
    with pytest.raises(ValueError, match=r"scales must be contiguous \[8\]"):
        int8_gemm(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(9))


def test_the_layers_gpu_path_calls_the_kernels_with_their_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """What AWQ and int8 layers hand the kernels where x is on a GPU (here: the interpreter stands in): the
    product of the weight they stand for, from one kernel call each."""
    calls: list[str] = []

    def spy(name: str):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name)
            return getattr(triton_quant_gemm, name)(*args, **kwargs)

        return call

    kernels = SimpleNamespace(awq_gemm=spy("awq_gemm"), int8_gemm=spy("int8_gemm"))
    for module in (quant_awq, quant_int8):
        monkeypatch.setattr(module, "gpu_kernels", lambda x: kernels)
    qweight, qzeros, scales = _awq(64, 24, 32)
    awq = QuantLinear(quant_awq.AwqMethod(32), {"qweight": qweight, "qzeros": qzeros, "scales": scales}, 24, 64)
    int8 = QuantLinear.quantized(quant_int8.Int8Method(), torch.randn(40, 64))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    for layer in (awq, int8):
        _close(layer(x), x @ layer.dequantize().t(), torch.float32)
    assert calls == ["awq_gemm", "int8_gemm"]
