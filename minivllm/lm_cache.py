"""LMCache: the articles' name for the KV offload tiers (docs/guide.md, "KV offload tiers"), as one object that
`LLM(..., cache=)` and `AsyncLLMEngine(..., cache=)` take.

It adds no cache of its own: it is spelled into the tier settings that exist (`kv_offload_ram` or
`kv_offload_disk` and `kv_offload_disk_size`, per worker, and `kv_offload_policy`), so blocks evicted from the
device's prefix cache go to host RAM or to a file, and a request whose prefix returns loads them back instead of
recomputing them. Its hits are the `cache_hit_rate` metric's ram and disk tiers, and `MemoryMonitor`'s."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from settings.scheduler import KV_OFFLOAD_POLICIES
from settings.worker import offload_dir_problem, parse_size

OFFLOAD_TARGETS = ("ram", "disk")


class LMCache:
    """`LMCache(capacity="20GB", policy="arc", offload_to="disk")`: an offload tier of `capacity` per worker
    ("20GB", "512MiB", or bytes), replaced by ARC or LRU. `path`: the disk tier's folder, kept across restarts
    (a new engine on it starts with the blocks it holds); None: a temporary folder removed with this object.
    ValueError naming the field for a bad value."""

    def __init__(
        self, capacity: str | int = "20GB", policy: str = "arc", offload_to: str = "ram", path: str | None = None
    ) -> None:
        self.capacity_bytes = _capacity(capacity)
        if policy not in KV_OFFLOAD_POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(KV_OFFLOAD_POLICIES)}, got {policy!r}")
        if offload_to not in OFFLOAD_TARGETS:
            raise ValueError(f"offload_to: must be one of {', '.join(OFFLOAD_TARGETS)}, got {offload_to!r}")
        if path is not None and offload_to != "disk":
            raise ValueError(f"path: a folder is for offload_to='disk', not {offload_to!r}")
        self.policy, self.offload_to = policy, offload_to
        self._temporary: tempfile.TemporaryDirectory[str] | None = None
        if offload_to == "disk" and path is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="minivllm-lmcache-")
            path = self._temporary.name
        self.path = str(Path(path).expanduser()) if path is not None else None
        problem = offload_dir_problem(self.path, "path:") if self.path is not None else ""
        if problem:
            raise ValueError(problem)

    @property
    def capacity_gib(self) -> float:
        return self.capacity_bytes / 2**30

    def settings(self) -> dict[str, Any]:
        """The engine and worker settings this cache stands for (LLM's keywords)."""
        if self.offload_to == "ram":
            return {"kv_offload_ram": self.capacity_gib, "kv_offload_policy": self.policy}
        return {
            "kv_offload_disk": self.path,
            "kv_offload_disk_size": self.capacity_gib,
            "kv_offload_policy": self.policy,
        }

    def __repr__(self) -> str:
        where = f", path={self.path!r}" if self.path else ""
        return f"LMCache(capacity={self.capacity_bytes}, policy={self.policy!r}, offload_to={self.offload_to!r}{where})"


def with_cache(cache: LMCache | None, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` and those of `cache`; ValueError naming a setting given both ways."""
    if cache is None:
        return settings
    if not isinstance(cache, LMCache):
        raise TypeError(f"cache: must be a minivllm.LMCache, got {type(cache).__name__}")
    implied = cache.settings()
    both = sorted(set(implied) & set(settings))
    if both:
        raise ValueError(f"{both[0]}: given both as a keyword and by cache={cache!r}; give one")
    return {**settings, **implied}


def _capacity(value: str | int) -> int:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"capacity: must be a size such as '20GB' or a byte count, got {value!r}")
    try:
        size = parse_size(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"capacity: must be a size such as '20GB', '512MiB' or a byte count, got {value!r}") from None
    if size <= 0:
        raise ValueError(f"capacity: must be more than 0 bytes, got {value!r}")
    return size
