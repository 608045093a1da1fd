"""Which attention implementation `select_attention_backend` hands out, and when it refuses."""

import dataclasses

import pytest
import torch

from kernels import backend, cpu_attention, cpu_glue, torch_attention
from kernels.backend import select_attention_backend

pytestmark = pytest.mark.model

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only named, never touched: selection works on machines without a GPU


def test_unknown_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_attention_backend("flash", CPU)


def test_cpu_gets_the_torch_reference_when_asked() -> None:
    chosen = select_attention_backend("torch", CPU)
    assert chosen.name == "torch"
    assert chosen.write_kv is torch_attention.write_kv
    assert chosen.decode_attention is torch_attention.paged_decode_attention
    assert chosen.prefill_attention is torch_attention.paged_prefill_attention


@pytest.mark.parametrize("name", ["auto", "native"])
def test_cpu_gets_the_native_kernel(name: str) -> None:
    chosen = select_attention_backend(name, CPU)
    assert chosen.name == "native"
    assert chosen.write_kv is cpu_glue.write_kv  # the C copy, torch's for a quantized cache
    assert chosen.plan_decode is cpu_attention.plan_decode
    assert chosen.prefill_attention is torch_attention.paged_prefill_attention


def test_auto_on_cpu_without_a_compiler_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "load", lambda *shape: None)
    assert select_attention_backend("auto", CPU).name == "torch"
    with pytest.raises(ValueError, match="could not be built"):
        select_attention_backend("native", CPU)


def test_native_on_cuda_is_an_error() -> None:
    with pytest.raises(ValueError, match="CPU devices only"):
        select_attention_backend("native", CUDA)


def test_torch_is_honoured_on_cuda() -> None:
    assert select_attention_backend("torch", CUDA).name == "torch"


def test_auto_on_cuda_is_triton() -> None:
    pytest.importorskip("triton")
    from kernels import triton_attention

    chosen = select_attention_backend("auto", CUDA)
    assert chosen.name == "triton"
    assert chosen.decode_attention is triton_attention.paged_decode_attention


def test_auto_on_cuda_falls_back_to_torch_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert select_attention_backend("auto", CUDA).name == "torch"


def test_triton_without_the_package_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="not installed"):
        select_attention_backend("triton", CUDA)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_attention_backend("triton", CPU)


def test_triton_on_cpu_with_the_interpreter() -> None:
    pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1
    assert select_attention_backend("triton", CPU).name == "triton"


def test_triton_on_other_devices_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="CUDA devices only"):
        select_attention_backend("triton", torch.device("meta"))


def test_backend_is_frozen() -> None:
    chosen = select_attention_backend("torch", CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.name = "other"  # type: ignore[misc]


def test_a_users_backend_is_loaded_from_module_and_class() -> None:
    chosen = select_attention_backend("deploy.custom_attention:PaddedDecodeAttention", CPU)
    assert chosen.name == "deploy.custom_attention:PaddedDecodeAttention"
    assert chosen.decode_attention.__self__.__class__.__name__ == "PaddedDecodeAttention"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "message"),
    [  # the last two: a class that cannot be built without arguments, one without the three methods
        ("no_such_module:Backend", "cannot load attention backend 'no_such_module:Backend'"),
        ("deploy.custom_attention:Missing", "cannot load attention backend 'deploy.custom_attention:Missing'"),
        ("deploy.custom_attention:torch_attention", "is not a class"),
        ("kernels.backend:AttentionBackend", "cannot build attention backend 'kernels.backend:AttentionBackend'"),
        ("collections:OrderedDict", "has no method write_kv, decode_attention, prefill_attention"),
    ],
)
def test_a_broken_users_backend_is_named_in_the_error(name: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        select_attention_backend(name, CPU)
    assert message in str(err.value)


def test_the_example_users_backend_matches_hf(tiny_llama_dir) -> None:  # type: ignore[no-untyped-def]
    """deploy/custom_attention.py through the model runner: greedy tokens are HF's at float32 precision."""
    import random

    from tests.support.engine import generate, load_runner
    from tests.support.models import assert_teacher_forced, load_hf

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 40)]
    runner = load_runner(tiny_llama_dir, 24, 16, backend="deploy.custom_attention:PaddedDecodeAttention")
    outputs, _ = generate(tiny_llama_dir, runner, prompts, [12, 20, 9], max_num_batched_tokens=32)
    hf = load_hf(tiny_llama_dir)
    for output, prompt, wanted in zip(outputs, prompts, [12, 20, 9]):
        assert len(output) == wanted
        assert_teacher_forced(hf, prompt, output)


def test_the_worker_flag_takes_names_module_class_and_kernels_with_their_library(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from worker_node.worker import build_parser

    parser = build_parser()
    kernel = '{"library":"/x/lib.so","params":{"tile":4},"type":"mine"}'
    for value in ("native", "deploy.custom_attention:PaddedDecodeAttention", "mine=/x/lib.so", kernel):
        assert parser.parse_args(["--attention-backend", value]).attention_backend == value  # loaded by the worker
    refusals = {
        "flash": "expected one of auto, triton, native, torch, module:Class or NAME=PATH.so (a compiled kernel), "
        "got 'flash'",  # a bare name: no process that parses flags has registered a kernel
        "mine=": "NAME=PATH needs the library's path after '='",
        '{"type": "mine"': "is not valid JSON",
    }
    for value, message in refusals.items():
        with pytest.raises(SystemExit):
            parser.parse_args(["--attention-backend", value])
        assert message in capsys.readouterr().err
