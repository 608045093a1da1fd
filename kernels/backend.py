"""Choosing the attention implementation: Triton kernels on CUDA, the compiled CPU kernel on CPU, the torch
reference wherever neither applies.

Triton is imported only when its backend is chosen, so CPU-only installs never need it.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from kernels.interface import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "triton", "native", "torch")


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
    )


def _native_backend() -> AttentionBackend | None:
    """The torch backend with decode attention swapped for the compiled CPU kernel; None if it cannot build."""
    from kernels import cpu_attention, torch_attention

    if cpu_attention.load() is None:  # a probe build: the model's own shape is built on the first decode
        return None
    return AttentionBackend(
        "native",
        torch_attention.write_kv,
        cpu_attention.NativeDecodeAttention(torch_attention.paged_decode_attention),
        torch_attention.paged_prefill_attention,
    )


def _triton_backend() -> AttentionBackend:
    from kernels import triton_attention

    return AttentionBackend(
        "triton",
        triton_attention.write_kv,
        triton_attention.paged_decode_attention,
        triton_attention.paged_prefill_attention,
    )


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: Triton on CUDA (torch if triton is missing), native on CPU (torch if it cannot be built);
    `triton`/`native`/`torch`: as named.

    `triton` on a CPU device runs the kernels in Triton's interpreter, so it needs `TRITON_INTERPRET=1`.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
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
