"""The Python side of kernels/csrc/custom_attention_abi.h: a compiled attention library, loaded with ctypes and
checked against the ABI before anything calls it.

A library that cannot be used is refused when it is loaded (at `register_kernel`, or when a worker starts), with
the file and the reason (not loadable, a required symbol missing, another ABI version), instead of at the first
step. No torch here: the tensors are kernels/compiled_attention.py's business.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ABI_VERSION = 1  # MINIVLLM_ATTENTION_ABI_VERSION of the header
HEADER = "kernels/csrc/custom_attention_abi.h"
OK, DECLINED = 0, 1  # MINIVLLM_ATTENTION_OK, MINIVLLM_ATTENTION_DECLINED

VERSION_SYMBOL = "minivllm_attention_abi_version"
DECODE_SYMBOL = "minivllm_decode_attention"
PREFILL_SYMBOL = "minivllm_prefill_attention"
WRITE_KV_SYMBOL = "minivllm_write_kv"
CONFIGURE_SYMBOL = "minivllm_attention_configure"
REQUIRED = (VERSION_SYMBOL, DECODE_SYMBOL)

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
# The argument types of each function, in the header's order.
_DECODE_ARGS = [_ptr] * 6 + [_i64] * 7 + [_f32, _i64, _f32, _ptr]
_PREFILL_ARGS = [_ptr] * 7 + [_i64] * 8 + [_f32, _i64, _f32, _ptr]
_WRITE_KV_ARGS = [_ptr] * 5 + [_i64] * 4 + [_ptr]


class AbiError(ValueError):
    """A library that does not implement the ABI, or cannot be loaded at all."""


@dataclass(frozen=True, eq=False)
class AttentionLibrary:
    """A loaded library that passed the checks; its optional functions are None where it does not export them."""

    path: Path
    handle: ctypes.CDLL
    decode: Any  # ctypes function pointers, typed by `_typed`
    prefill: Any | None
    write_kv: Any | None
    configure: Any | None

    def configure_with(self, params: dict[str, Any]) -> None:
        """Hand the library its params as JSON (`minivllm_attention_configure`); AbiError naming `attention.params`
        when it takes none or refuses these."""
        text = json.dumps(params, sort_keys=True)
        if self.configure is None:
            if params:
                raise AbiError(
                    f"attention.params: {self.path} exports no {CONFIGURE_SYMBOL}, so it takes no params (got {text})"
                )
            return
        code = self.configure(text.encode())
        if code != OK:
            raise AbiError(f"attention.params: {self.path} refused {text} ({CONFIGURE_SYMBOL} returned {code})")


def load_library(path: Path) -> AttentionLibrary:
    """`path` loaded and checked: AbiError naming the file when it is missing, not loadable, lacks a required
    symbol, or speaks another ABI version."""
    if not path.is_file():
        raise AbiError(f"{path}: no such file")
    try:
        handle = ctypes.CDLL(str(path))  # RTLD_LOCAL: two libraries' symbols never mix
    except OSError as exc:
        raise AbiError(f"{path} is not a loadable shared library: {exc}") from exc
    missing = [name for name in REQUIRED if not hasattr(handle, name)]
    if missing:
        raise AbiError(
            f"{path} does not export {', '.join(missing)}, which the minivllm attention ABI requires ({HEADER})"
        )
    version = _typed(handle, VERSION_SYMBOL, [], _i32)()
    if version != ABI_VERSION:
        raise AbiError(
            f"{path} implements minivllm attention ABI version {version}, this minivllm speaks version "
            f"{ABI_VERSION}: rebuild it against {HEADER}"
        )
    return AttentionLibrary(
        path,
        handle,
        _typed(handle, DECODE_SYMBOL, _DECODE_ARGS, _i32),
        _optional(handle, PREFILL_SYMBOL, _PREFILL_ARGS),
        _optional(handle, WRITE_KV_SYMBOL, _WRITE_KV_ARGS),
        _optional(handle, CONFIGURE_SYMBOL, [ctypes.c_char_p]),
    )


def _typed(handle: ctypes.CDLL, name: str, args: list[Any], result: Any) -> Any:
    function = getattr(handle, name)
    function.argtypes = args
    function.restype = result
    return function


def _optional(handle: ctypes.CDLL, name: str, args: list[Any]) -> Any | None:
    return _typed(handle, name, args, _i32) if hasattr(handle, name) else None
