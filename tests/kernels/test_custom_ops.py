"""Compiled attention kernels (kernels/csrc/custom_attention_abi.h): the example library of deploy/, compiled here,
registered by name and selected as a backend, against the torch reference; the proof that its code is what ran
(its exported call counters); and every refusal, each naming what is wrong."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import attention_abi, compiled_attention, custom_kernels, torch_attention
from kernels.backend import check_cache_dtype, select_attention_backend
from proto.attention_setting import AttentionChoice
from tests.support.custom_kernel import build_example, build_library, counter
from tests.support.paged_inputs import make_paged_batch
from tests.support.paths import REPO

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
H, HKV, D, BS = 6, 2, 16, 4  # grouped-query: 3 query heads per KV head


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no kernel registered (the libraries stay loaded: their counters are read as deltas)."""
    monkeypatch.setattr(custom_kernels, "_registry", {})
    yield


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_example(tmp_path_factory.mktemp("custom-kernel"))


@pytest.fixture(scope="module")
def decode_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_example(tmp_path_factory.mktemp("custom-kernel"), "DECODE_ONLY")


def decode_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k_cache, v_cache, block_tables, seq_lens of a random decode batch (grouped-query heads)."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([1, 7, 13, 20], [1, 7, 13, 20], HKV, D, BS, torch.float32, gen)
    q = torch.randn(4, H, D, generator=gen)
    return q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens


@pytest.mark.parametrize("window", [0, 5])
def test_decode_is_the_references_and_runs_in_the_library(example: Path, window: int) -> None:
    custom_kernels.register_kernel("my_attention", example)
    backend = select_attention_backend("my_attention", CPU)
    assert backend.name == "my_attention" and backend.cache_dtypes == (torch.float32,)
    q, k_cache, v_cache, tables, lens = decode_inputs(window)
    before = counter(example, "example_decode_calls")
    out = backend.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, window=window)
    assert counter(example, "example_decode_calls") == before + 1
    ref = torch_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_declined_call_runs_the_reference(example: Path) -> None:
    backend = select_attention_backend(f"my_attention={example}", CPU)  # the worker's form: registers, then uses
    q, k_cache, v_cache, tables, lens = decode_inputs(1)
    declined, ran = counter(example, "example_declined_calls"), counter(example, "example_decode_calls")
    out = backend.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, softcap=2.0)
    assert counter(example, "example_declined_calls") == declined + 1  # the example declines soft-caps
    assert counter(example, "example_decode_calls") == ran
    ref = torch_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, softcap=2.0)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_write_kv_and_prefill_run_in_the_library_when_it_exports_them(example: Path) -> None:
    custom_kernels.register_kernel("my_attention", example)
    backend = select_attention_backend("my_attention", CPU)
    gen = torch.Generator().manual_seed(2)
    seq_lens, cached = [9, 5, 14], [4, 0, 11]  # a cached prefix, none, a long one
    batch = make_paged_batch(seq_lens, cached, HKV, D, BS, torch.float32, gen)
    new = [range(c, n) for c, n in zip(cached, seq_lens)]
    key = torch.cat([batch.keys[i][r.start :] for i, r in enumerate(new)])
    value = torch.cat([batch.values[i][r.start :] for i, r in enumerate(new)])
    slots = torch.cat([batch.slots(i, r) for i, r in enumerate(new)])
    q = torch.randn(key.shape[0], H, D, generator=gen)
    cu = torch.tensor([0, 5, 10, 13], dtype=torch.int32)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    torch_attention.write_kv(key, value, ref_k, ref_v, slots)
    writes, prefills = counter(example, "example_write_kv_calls"), counter(example, "example_prefill_calls")
    backend.write_kv(key, value, batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache, ref_k) and torch.equal(batch.v_cache, ref_v)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, 0.25)
    out = backend.prefill_attention(q, key, value, *args, window=6)
    ref = torch_attention.paged_prefill_attention(q, key, value, *args, window=6)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert counter(example, "example_write_kv_calls") == writes + 1
    assert counter(example, "example_prefill_calls") == prefills + 1


def test_a_decode_only_library_keeps_the_reference_write_kv_and_prefill(decode_only: Path) -> None:
    backend = select_attention_backend(f"mine={decode_only}", CPU)
    assert backend.write_kv is torch_attention.write_kv
    assert backend.prefill_attention is torch_attention.paged_prefill_attention
    assert isinstance(backend.decode_attention, compiled_attention.CompiledDecode)


def test_an_error_value_fails_the_call_naming_the_function_and_value(example: Path) -> None:
    backend = select_attention_backend(f"my_attention={example}", CPU)
    q, k_cache, v_cache, *_ = decode_inputs(3)
    rows = torch.zeros(1, HKV, D)
    outside = torch.tensor([k_cache.shape[0] * BS], dtype=torch.int64)  # the example returns 3 for it
    with pytest.raises(
        RuntimeError, match=rf"'my_attention': minivllm_write_kv of {re.escape(str(example))} returned 3"
    ):
        backend.write_kv(rows, rows, k_cache, v_cache, outside)


def test_params_reach_the_library_and_a_bad_one_is_refused(example: Path, tmp_path: Path) -> None:
    trace = tmp_path / "calls.txt"
    setting = AttentionChoice("my_attention", str(example), {"trace": str(trace)}).setting()
    backend = select_attention_backend(setting, CPU)  # the JSON form, as a worker process gets it
    backend.decode_attention(*decode_inputs(4), 0.25)
    assert int(trace.read_text()) == counter(example, "example_decode_calls")
    with pytest.raises(ValueError, match=r'attention.params: .*example.so refused \{"tile": 4\}'):
        select_attention_backend(AttentionChoice("my_attention", "", {"tile": 4}).setting(), CPU)
    select_attention_backend("my_attention", CPU)  # configured again, with no params: the trace stops
    trace.unlink()
    backend.decode_attention(*decode_inputs(4), 0.25)
    assert not trace.exists()


def test_params_for_a_library_without_configure_are_refused(decode_only: Path) -> None:
    setting = AttentionChoice("mine", str(decode_only), {"tile": 4}).setting()
    with pytest.raises(ValueError, match="attention.params: .* exports no minivllm_attention_configure"):
        select_attention_backend(setting, CPU)


def test_a_worker_refuses_a_cache_the_kernel_cannot_read(example: Path) -> None:
    backend = select_attention_backend(f"my_attention={example}", CPU)
    check_cache_dtype(backend, torch.float32)
    for dtype in (torch.bfloat16, torch.int8):
        with pytest.raises(ValueError, match=f"'my_attention' reads float32 KV caches only.*{str(dtype)[6:]}"):
            check_cache_dtype(backend, dtype)
    check_cache_dtype(select_attention_backend("torch", CPU), torch.bfloat16)  # a built-in one reads any


# ---- refusals of libraries and names


BROKEN = {
    "no_version.so": (
        "#include <stdint.h>\nint32_t minivllm_decode_attention(void) { return 0; }\n",
        "does not export minivllm_attention_abi_version, which the minivllm attention ABI requires",
    ),
    "no_decode.so": (
        "#include <stdint.h>\nint32_t minivllm_attention_abi_version(void) { return 1; }\n",
        "does not export minivllm_decode_attention",
    ),
    "version_2.so": (
        "#include <stdint.h>\nint32_t minivllm_attention_abi_version(void) { return 2; }\n"
        "int32_t minivllm_decode_attention(void) { return 0; }\n",
        "implements minivllm attention ABI version 2, this minivllm speaks version 1",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_library_off_the_abi_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    source, message = BROKEN[name]
    library = build_library(source, tmp_path / name)
    with pytest.raises(ValueError, match=rf"register_kernel: kernel 'bad': {re.escape(f'{library} {message}')}"):
        custom_kernels.register_kernel("bad", library)
    assert "bad" not in custom_kernels.registered_kernels()


def test_a_file_that_is_no_library_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "custom_attention.so"
    fake.write_text("not an ELF file")
    with pytest.raises(ValueError, match=rf"{re.escape(str(fake))} is not a loadable shared library"):
        custom_kernels.register_kernel("my_attention", fake)
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'missing.so'))}: no such file"):
        custom_kernels.register_kernel("my_attention", tmp_path / "missing.so")


def test_names_are_refused_when_taken_or_built_in(example: Path, decode_only: Path) -> None:
    custom_kernels.register_kernel("my_attention", example)
    custom_kernels.register_kernel("my_attention", example)  # the same again: nothing to do
    with pytest.raises(ValueError, match=rf"'my_attention' is already registered as {re.escape(str(example))}"):
        custom_kernels.register_kernel("my_attention", decode_only)
    with pytest.raises(ValueError, match="'torch' is a built-in attention backend"):
        custom_kernels.register_kernel("torch", example)
    with pytest.raises(ValueError, match="a kernel name is a word"):
        custom_kernels.register_kernel("my attention", example)
    assert custom_kernels.registered_kernels() == {"my_attention": example}


def test_an_unknown_name_lists_the_registered_ones(example: Path) -> None:
    custom_kernels.register_kernel("my_attention", example)
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; registered kernels: my_attention \("):
        select_attention_backend("flash", CPU)


def test_the_workers_setting_carries_a_registered_kernels_path(example: Path) -> None:
    custom_kernels.register_kernel("my_attention", example)
    assert custom_kernels.worker_setting("my_attention") == f"my_attention={example}"
    assert custom_kernels.worker_setting("auto", {"type": "my_attention", "params": {"trace": "t"}}) == (
        f'{{"library":"{example}","params":{{"trace":"t"}},"type":"my_attention"}}'
    )
    assert custom_kernels.worker_setting("auto", {"type": "torch"}) == "torch"
    assert custom_kernels.worker_setting("deploy.custom_attention:PaddedDecodeAttention").endswith(
        ":PaddedDecodeAttention"
    )
    with pytest.raises(ValueError, match="attention.type: unknown attention backend 'nope'; registered kernels: my_"):
        custom_kernels.worker_setting("auto", {"type": "nope"})
    with pytest.raises(ValueError, match="attention: given together with attention_backend='torch'"):
        custom_kernels.worker_setting("torch", {"type": "my_attention"})


def test_the_abi_constants_are_the_headers() -> None:
    header = (REPO / attention_abi.HEADER).read_text()
    assert f"#define MINIVLLM_ATTENTION_ABI_VERSION {attention_abi.ABI_VERSION}\n" in header
    assert f"#define MINIVLLM_ATTENTION_OK {attention_abi.OK}\n" in header
    assert f"#define MINIVLLM_ATTENTION_DECLINED {attention_abi.DECLINED}\n" in header
    for symbol in (*attention_abi.REQUIRED, attention_abi.PREFILL_SYMBOL, attention_abi.WRITE_KV_SYMBOL):
        assert f" {symbol}(" in header
