"""The LoRA adapters a server serves, by name: from `--lora-modules` at start, or loaded and unloaded at run time
(`POST /v1/load_lora_adapter`, `LLM.generate(..., lora_request=...)`).

Registering reads the adapter whole and checks it against the base model (proto/lora.py: rank, modules, shapes,
finite values and scale, no pickle), and keeps its content's checksum: the workers read it again when a request
first runs with it and check they read the same bytes, so a file changed or cut after registering fails only the
requests naming it. Unloading only stops new requests from naming it: requests already running with it finish.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from proto.lora import BaseShapes, inspect_adapter
from scheduler_node.core.lora_slots import LoraRef

_NAME = re.compile(r"[\w.:/@+-]{1,128}")  # whole names only: fullmatch, so no "x\n"
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """The LoRA flags besides --max-loras (a scheduler setting: scheduler_node/core/config.py)."""

    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) registered at start
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` (vLLM's --lora-modules spelling) as (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return name, path


class UnknownAdapter(KeyError):
    """No adapter of this name is loaded."""


class AdapterExists(ValueError):
    """An adapter of this name is loaded already."""


class LoraRegistry:
    def __init__(self, base: BaseShapes, max_rank: int, base_name: str = "") -> None:
        self.base = base
        self.max_rank = max_rank
        self.base_name = base_name  # the base model's served name: no adapter may take it
        self._by_name: dict[str, LoraRef] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoraRef:
        """Register an adapter (ValueError naming what is wrong: name, folder, config, tensors)."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"lora_name {name!r}: 1 to 128 letters, digits or ._:/@+-")
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self._by_name:
            raise AdapterExists(f"lora_name {name!r} is loaded already; unload it first")
        info = inspect_adapter(path, self.base, self.max_rank)
        ref = LoraRef(name, next(self._ids), str(Path(info.folder).resolve()), info.sha256, info.nbytes)
        self._by_name[name] = ref
        return ref

    def remove(self, name: str) -> LoraRef:
        ref = self._by_name.pop(name, None)
        if ref is None:
            raise UnknownAdapter(name)
        return ref

    def get(self, name: str) -> LoraRef | None:
        return self._by_name.get(name)

    def refs(self) -> list[LoraRef]:
        return list(self._by_name.values())
