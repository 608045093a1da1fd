"""What this CPU can do, read from /proc/cpuinfo: keys the native kernel's build and picks the CPU dtype."""

from __future__ import annotations

import functools
import platform

# Instructions that make bf16 matrix products faster than float32 ones (dot products of bf16 pairs into
# float32): AVX-512 BF16 (Cooper Lake, Zen 4 and later) and AMX (Sapphire Rapids and later).
FAST_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags_line() -> str:
    """The `flags` (x86) or `Features` (Arm) line of /proc/cpuinfo; the processor name where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def has_fast_bf16(flags_line: str | None = None) -> bool:
    """True on CPUs with bf16 dot-product instructions (where bf16 weights beat float32 ones)."""
    line = cpu_flags_line() if flags_line is None else flags_line
    return bool(FAST_BF16_FLAGS & set(line.partition(":")[2].split()))
