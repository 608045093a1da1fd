"""The OpenMP runtime torch and the CPU kernels share: each thread that starts parallel work keeps its own pool.

libgomp gives every thread that opens a parallel region a pool of worker threads, kept until that thread exits.
Once it manages more threads than there are CPUs, its idle workers spin about 100 times instead of ~300,000 before
they sleep, so every parallel region has to wake its workers from a futex: ~60 µs each in this project's 2-core
VMs, where a SmolLM2 decode step opens ~150 (its matmuls and attention calls). A worker loads its model on one
thread and runs its steps on another (the step thread), so the loading thread's pool is let go once the model is
loaded: the step thread's is then the only one, and its workers spin between regions.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

RUNTIMES = ("libgomp", "libiomp", "libomp")  # GNU's (torch's Linux wheels), Intel's, LLVM's
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: let the threads go, keep what can be restarted


_found: list[ctypes.CDLL] = []  # the runtime, once found (not found is not kept: torch may load it later)


def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already loaded in this process (opened again by its path: the same library), or None.
    Looked for again until found: `LLM` releases its caller's pool before the engine thread has imported torch."""
    if not _found:
        library = _loaded_runtime()
        if library is not None:
            _found.append(library)
    return _found[0] if _found else None


def _loaded_runtime() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if path.rpartition("/")[2].startswith(RUNTIMES):
            library = ctypes.CDLL(path)
            if hasattr(library, "omp_pause_resource_all"):
                library.omp_pause_resource_all.restype = ctypes.c_int
                library.omp_pause_resource_all.argtypes = [ctypes.c_int]
                return library
    return None


def release_thread_pool() -> bool:
    """Let the calling thread's OpenMP workers go (`omp_pause_resource_all`, soft; a later parallel region on this
    thread makes new ones). False where no runtime with that call is loaded or it refused (inside a region)."""
    library = _runtime()
    if library is None:
        return False
    return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
