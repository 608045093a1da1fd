"""Compiled attention kernels by name: the design article's `_custom_ops.register_kernel("my_attention", "x.so")`.

The registry is this process's: an in-process worker (`LLM` with a world of one) finds a name registered here.
Worker processes cannot, so what the engine hands them is `worker_setting`'s string, which carries the library's
path (and params) with the name (proto/attention_setting.py); each worker registers the library itself when it
selects its backend. One mechanism either way: a name resolves to a library here, to a path on the way out.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from kernels.attention_abi import AbiError, AttentionLibrary, load_library
from proto.attention_setting import BUILT_IN, AttentionChoice, check_kernel_name, from_mapping, parse_setting

_lock = threading.Lock()  # the engine thread may select a backend while the caller registers
_registry: dict[str, AttentionLibrary] = {}


def register_kernel(name: str, path: str | os.PathLike[str]) -> None:
    """Load the compiled attention library at `path` (kernels/csrc/custom_attention_abi.h) and make it selectable
    as `name`. ValueError when the name is taken by another library or a built-in backend, or the library is not
    usable (not loadable, a required symbol missing, another ABI version), naming the file. Registering the same
    library under the same name again does nothing."""
    _register(name, path, "register_kernel")


def registered_kernels() -> dict[str, Path]:
    """Every registered name with its library's path."""
    with _lock:
        return {name: library.path for name, library in _registry.items()}


def library_of(choice: AttentionChoice, where: str = "attention backend") -> AttentionLibrary:
    """The library a compiled kernel's choice names: its `library` registered under its name first when it has
    one. ValueError naming `where` and the registered names when the name is unknown."""
    if choice.library:
        _register(choice.type, choice.library, where)
    with _lock:
        library = _registry.get(choice.type)
    if library is None:
        raise ValueError(unknown_kernel(choice.type, where))
    return library


def unknown_kernel(name: str, where: str) -> str:
    registered = ", ".join(sorted(registered_kernels())) or "none"
    return (
        f"{where}: unknown attention backend {name!r}; registered kernels: {registered} (register one with "
        f"minivllm._custom_ops.register_kernel, or name its library as {name}=PATH.so); built in: "
        f"{', '.join(BUILT_IN)}; or package.module:Class"
    )


def worker_setting(setting: str, attention: Mapping[str, object] | None = None) -> str:
    """The attention setting for workers that may run in other processes: `attention` (a model config's
    `attention` section) or `setting` (`attention_backend`), with a registered kernel's library path filled in.
    ValueError, naming the key, for anything a worker would refuse by name."""
    if attention is not None and setting != "auto":
        raise ValueError(f"attention: given together with attention_backend={setting!r}; give one of them")
    where = "attention.type" if attention is not None else "attention_backend"
    choice = from_mapping(attention) if attention is not None else parse_setting(setting)
    if choice.compiled:
        library = library_of(choice, where)
        choice = dataclasses.replace(choice, library=str(library.path))
    return choice.setting()


def _register(name: str, path: str | os.PathLike[str], where: str) -> AttentionLibrary:
    check_kernel_name(name, where)
    resolved = Path(path).expanduser().resolve()
    with _lock:
        known = _registry.get(name)
        if known is not None:
            if known.path != resolved:
                raise ValueError(f"{where}: {name!r} is already registered as {known.path}, not {resolved}")
            return known
        try:
            library = load_library(resolved)
        except AbiError as exc:
            raise ValueError(f"{where}: kernel {name!r}: {exc}") from exc
        _registry[name] = library
        return library
