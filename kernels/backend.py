"""Choosing the attention implementation: Triton kernels on CUDA, the compiled CPU kernel on CPU, the torch
reference wherever neither applies, a user's own as `module:Class`, or a user's compiled library by the name it
was registered under (kernels/custom_kernels.py; the setting's forms are proto/attention_setting.py's).

Triton is imported only when its backend is chosen, so CPU-only installs never need it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
from collections.abc import Callable

import torch

from kernels.interface import AttentionBackend
from proto.attention_setting import parse_setting
from settings.plugins import load_named

logger = logging.getLogger(__name__)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _torch_backend() -> AttentionBackend:
    from kernels import torch_attention

    return AttentionBackend(
        "torch",
        torch_attention.write_kv,
        torch_attention.paged_decode_attention,
        torch_attention.paged_prefill_attention,
        plan_decode=torch_attention.decode_layout,
    )


def _native_backend() -> AttentionBackend | None:
    """The torch backend with decode attention and the KV write swapped for compiled CPU kernels; None if they
    cannot build."""
    from kernels import cpu_attention, cpu_glue, torch_attention

    if cpu_attention.load() is None:  # a probe build: the model's own shape is built on the first decode
        return None
    return AttentionBackend(
        "native",
        cpu_glue.write_kv,
        cpu_attention.NativeDecodeAttention(torch_attention.paged_decode_attention),
        torch_attention.paged_prefill_attention,
        plan_decode=cpu_attention.plan_decode,
    )


def _triton_backend() -> AttentionBackend:
    from kernels import triton_attention

    return AttentionBackend(
        "triton",
        triton_attention.write_kv,
        triton_attention.paged_decode_attention,
        triton_attention.paged_prefill_attention,
    )


def _user_backend(name: str) -> AttentionBackend:
    """`module:Class`: an instance of the user's class (built without arguments) whose `write_kv`,
    `decode_attention` and `prefill_attention` take the arguments of `kernels.torch_attention`'s functions."""
    cls = load_named(name, "attention backend")
    if not isinstance(cls, type):
        raise ValueError(f"attention backend {name!r} is not a class")
    try:
        impl = cls()
    except Exception as exc:  # the user's constructor: whatever it raises, say whose it was
        raise ValueError(f"cannot build attention backend {name!r}: {exc}") from exc
    ops = ("write_kv", "decode_attention", "prefill_attention")
    missing = [op for op in ops if not callable(getattr(impl, op, None))]
    if missing:
        raise ValueError(f"attention backend {name!r} has no method {', '.join(missing)}")
    return AttentionBackend(name, impl.write_kv, impl.decode_attention, impl.prefill_attention)


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: Triton on CUDA (torch if triton is missing), native on CPU (torch if it cannot be built);
    `triton`/`native`/`torch`: as named; `module:Class`: the user's backend (see `_user_backend`).

    `triton` on a CPU device runs the kernels in Triton's interpreter, so it needs `TRITON_INTERPRET=1`.
    Any other name is a compiled kernel's: registered in this process, or given with its library (`NAME=PATH.so`,
    or the JSON form with params).
    """
    device = torch.device(device)
    choice = parse_setting(name)
    if choice.compiled:
        from kernels.compiled_attention import compiled_backend

        return compiled_backend(choice)
    name = choice.type  # the JSON form may name a built-in backend or module:Class too
    if ":" in name:
        return _user_backend(name)
    if name == "torch":
        return _torch_backend()
    if name == "native" or (name == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"attention backend 'native' runs on CPU devices only, got {device}")
        native = _native_backend()
        if native is not None:
            return native
        if name == "native":
            raise ValueError("attention backend 'native' requested but the CPU kernel could not be built")
        return _torch_backend()
    if name == "auto":
        if device.type != "cuda":
            return _torch_backend()
        if not triton_available():
            logger.warning("triton is not installed; using the torch attention backend on %s", device)
            return _torch_backend()
        return _triton_backend()
    if not triton_available():
        raise ValueError("attention backend 'triton' requested but the triton package is not installed")
    if device.type == "cpu" and not interpreter_enabled():
        raise ValueError(
            "attention backend 'triton' on a CPU device needs TRITON_INTERPRET=1 (Triton's interpreter, "
            "set before triton kernels are imported); use 'torch' or 'auto' for CPU workers"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"attention backend 'triton' supports CUDA devices only, got {device}")
    return _triton_backend()


def _takes_scales(op: Callable[..., object]) -> bool:
    """Whether `op` accepts the keyword arguments `k_scales` and `v_scales` (by name, or through **kwargs)."""
    try:
        params = inspect.signature(op).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let its first call say
        return True
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return any(p.kind == p.VAR_KEYWORD for p in params) or {"k_scales", "v_scales"} <= names


def check_cache_dtype(backend: AttentionBackend, kv_dtype: torch.dtype) -> None:
    """Refuse, before any memory is taken, a KV cache dtype that `backend` says it cannot read (`cache_dtypes`: a
    compiled kernel reads float32 only)."""
    if backend.cache_dtypes and kv_dtype not in backend.cache_dtypes:
        readable = ", ".join(str(d).removeprefix("torch.") for d in backend.cache_dtypes)
        raise ValueError(
            f"attention backend {backend.name!r} reads {readable} KV caches only, this worker's would be "
            f"{str(kv_dtype).removeprefix('torch.')}: run the model with dtype {readable} and --kv-cache-dtype auto"
        )


def check_reads_quantized(backend: AttentionBackend, kv_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before any memory is taken, a quantized KV cache (`kv_dtype` int8 or float8_e4m3fn) that `backend`
    cannot read: a user's backend whose operations take no scales, or fp8 in Triton on a GPU older than sm_89
    (the first with e4m3 conversions)."""
    ops: dict[str, Callable[..., object]] = {
        "write_kv": backend.write_kv,
        "decode_attention": backend.decode_attention,
        "prefill_attention": backend.prefill_attention,
    }
    blind = [name for name, op in ops.items() if not _takes_scales(op)]
    if blind:
        raise ValueError(
            f"attention backend {backend.name!r} cannot read a quantized KV cache: {', '.join(blind)} take no "
            "k_scales/v_scales keywords (see kernels/interface.py); use --kv-cache-dtype auto"
        )
    device = torch.device(device)
    if backend.name == "triton" and kv_dtype == torch.float8_e4m3fn and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"--kv-cache-dtype fp8_e4m3 with the triton backend needs a GPU of compute capability 8.9 or newer, "
                f"this one is {capability[0]}.{capability[1]}; use int8"
            )
