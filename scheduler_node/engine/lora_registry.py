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
from pathlib import Path

from proto.lora import BaseShapes, inspect_adapter
from scheduler_node.core.lora_slots import LoraRef

_NAME = re.compile(r"[\w.:/@+-]{1,128}")  # whole names only: fullmatch, so no "x\n"


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
