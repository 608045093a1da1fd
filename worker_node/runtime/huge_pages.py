"""Transparent huge pages for the weights a CPU decode step streams.

A decode step reads every weight once: on 4 KiB pages, a TLB miss (a page walk) every 4 KiB of the stream; on 2 MiB
pages, one every 2 MiB. Linux gives huge pages to anonymous memory only where asked
(`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most distributions), and the weights are written as
they load, many tensors, most under 2 MiB, packed side by side by the allocator: so once loaded they are collapsed
into huge pages where they lie (MADV_COLLAPSE, Linux 6.1+: the kernel copies them into huge pages in place, the
addresses unchanged; about 0.25 s per GiB, 0.1 s for SmolLM2's 300 MiB). SmolLM2 bf16, 16 sequences, 2 threads: a
decode step 19.4 -> 16.9 ms (docs/benchmarks.md). The KV cache stays on small pages: advised before its zeroing it
took 0.35 s more per GiB at start (the 5.4 GiB default: 1-3 s) for a step ~3 % faster at 64 sequences of 256
tokens.

It is advice: where the kernel refuses (older kernels, THP off, memory too fragmented) nothing changes but speed.
A worker's --no-huge-pages (settings/fast_paths.py) skips it: the loader is told not to call `collapse`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's madvise where this is Linux; else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned address ranges inside the CPU tensors' storages, those less than a huge page apart merged
    (the small tensors a model is made of lie side by side: together they fill huge pages)."""
    spans = sorted(
        {
            (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
            for t in tensors
            if t.device.type == "cpu" and t.untyped_storage().nbytes() > 0
        }
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1] + HUGE_PAGE:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    aligned = [(-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE) for start, end in merged]
    return [(start, end) for start, end in aligned if end > start]


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Move written CPU tensors onto huge pages where they lie. Bytes collapsed."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done = 0
    for start, end in _ranges(tensors):
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
        else:
            logger.debug("MADV_COLLAPSE of %d bytes: %s", end - start, os.strerror(ctypes.get_errno()))
    return done


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a model holds: parameters, buffers, and those its modules keep beside them (a quantized
    layer's repacked codes in `kernel`, an LM head's int8 codes in `int8`)."""
    found = [*module.parameters(), *module.buffers()]
    for child in module.modules():
        for value in (getattr(child, "kernel", None), getattr(child, "int8", None)):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else ()
            found += [t for t in items if isinstance(t, torch.Tensor)]
    return found
