"""The attention setting as it travels to the workers: one string, whichever way it was given.

The design article's model config enables a kernel with `{"attention": {"type": "my_attention", "params": {...}}}`;
the worker flag `--attention-backend` takes a name. Both are one setting, the string `WorkerOptions.attention_backend`,
which is all a worker process receives. So that a worker in another process (or on another host) can load a
compiled kernel it has never seen registered, the string carries the library's path, and its params when there
are any:

    auto | triton | native | torch     built in (kernels/backend.py)
    package.module:Class               a user's Python backend
    NAME                               a compiled kernel registered in this process (kernels/custom_kernels.py)
    NAME=PATH.so                       a compiled kernel: register PATH as NAME in the worker, then use it
    {"type": ..., "library": ..., "params": {...}}   the same as JSON, the only form that carries params

Pure Python: the scheduler's command lines check the string, the workers resolve it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BUILT_IN = ("auto", "triton", "native", "torch")
KEYS = ("type", "library", "params")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


@dataclass(frozen=True, slots=True)
class AttentionChoice:
    """One attention setting, parsed: `type` is a built-in name, `module:Class`, or a compiled kernel's name."""

    type: str
    library: str = ""  # a compiled kernel's shared library ("" : registered in the process that resolves it)
    params: dict[str, Any] = field(default_factory=dict)  # handed to the library's minivllm_attention_configure

    @property
    def compiled(self) -> bool:
        return self.type not in BUILT_IN and ":" not in self.type

    def setting(self) -> str:
        """The string form (`WorkerOptions.attention_backend`, `--attention-backend`): the shortest that says it."""
        if self.params:
            whole: dict[str, Any] = {"type": self.type, "params": self.params}
            if self.library:
                whole["library"] = self.library
            return json.dumps(whole, sort_keys=True, separators=(",", ":"))
        return f"{self.type}={self.library}" if self.library else self.type


def check_kernel_name(name: object, where: str) -> str:
    """`name` if it can name a compiled kernel (a word: letters, digits, `_`, `.`, `-`; not a built-in name)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: a kernel name is a word of letters, digits, '_', '.' or '-', got {name!r}")
    if name in BUILT_IN:
        raise ValueError(f"{where}: {name!r} is a built-in attention backend; choose another name")
    return name


def from_mapping(attention: object, where: str = "attention") -> AttentionChoice:
    """The model config's `attention` section (`{"type": ..., "library": ..., "params": {...}}`) as a choice;
    ValueError naming the key (`attention.type`, ...) that is wrong."""
    if not isinstance(attention, Mapping):
        raise ValueError(f"{where}: expected a mapping with a 'type' key, got {attention!r}")
    unknown = sorted(str(k) for k in attention if k not in KEYS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key; {where} takes {', '.join(KEYS)}")
    kind = attention.get("type")
    if not isinstance(kind, str) or not kind:
        raise ValueError(
            f"{where}.type: missing; name an attention backend ({', '.join(BUILT_IN)}, a registered kernel or "
            "module:Class)"
        )
    library = attention.get("library") or ""
    params = attention.get("params") or {}
    if not isinstance(library, str):
        raise ValueError(f"{where}.library: expected the path of a shared library, got {library!r}")
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}.params: expected a mapping, got {params!r}")
    choice = AttentionChoice(kind, library, dict(params))
    if choice.compiled:
        check_kernel_name(kind, f"{where}.type")
    elif library or params:
        key = "library" if library else "params"
        raise ValueError(f"{where}.{key}: {kind!r} is not a compiled kernel, so it takes no {key}")
    try:
        json.dumps(choice.params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}.params: not expressible as JSON ({exc})") from exc
    return choice


def parse_setting(text: str) -> AttentionChoice:
    """A setting string (see the module's doc) as a choice; ValueError saying what is wrong with it."""
    if text.startswith("{"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"attention setting {text!r} is not valid JSON: {exc}") from exc
        return from_mapping(whole)
    if "=" in text:
        name, _, library = text.partition("=")
        check_kernel_name(name, f"attention setting {text!r}")
        if not library:
            raise ValueError(f"attention setting {text!r}: NAME=PATH needs the library's path after '='")
        return AttentionChoice(name, library)
    if ":" in text:
        module, _, cls = text.partition(":")
        if not module or not cls.isidentifier():
            raise ValueError(f"attention setting {text!r}: expected package.module:Class")
        return AttentionChoice(text)
    if text not in BUILT_IN:
        check_kernel_name(text, "attention setting")
    return AttentionChoice(text)
