"""The LoRA adapters a server serves, by name: from `--lora-modules` at start, or loaded and unloaded at run time
(`POST /v1/load_lora_adapter`, `LLM.generate(..., lora_request=...)`).

Registering checks the adapter against the base model (proto/lora.py: rank, modules, shapes, no pickle) without
reading its tensors; the workers read them when a request first runs with it. Unloading only stops new requests
from naming it: requests already running with it finish.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from proto.lora import BaseShapes, inspect_adapter
from scheduler_node.core.lora_slots import LoraRef

_NAME = re.compile(r"^[\w.:/@+-]{1,128}$")


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
        if not _NAME.match(name):
            raise ValueError(f"lora_name {name!r}: 1 to 128 letters, digits or ._:/@+-")
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self._by_name:
            raise AdapterExists(f"lora_name {name!r} is loaded already; unload it first")
        info = inspect_adapter(path, self.base, self.max_rank)
        stat = info.weights.stat()
        # The prefix cache's salt: a changed file under the same path (after a restart: the disk tier) is another
        # adapter, whose KV blocks must not be shared.
        fingerprint = f"{info.folder}:{stat.st_size}:{stat.st_mtime_ns}"
        ref = LoraRef(name, next(self._ids), str(Path(info.folder).resolve()), fingerprint, info.nbytes)
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
