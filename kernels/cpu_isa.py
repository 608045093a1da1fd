"""Which instruction set the CPU matmul kernels use: chosen once from the CPU's flags, logged, overridable.

From the best down: `amx` (kernels/csrc/skinny_gemm_cpu.c on AMX tiles, Sapphire Rapids and later),
`avx512_bf16` (kernels/csrc/vector_gemm_cpu.c with VDPBF16PS: Zen 4, Cooper Lake) and `avx2` (the same source with
AVX2 + FMA + F16C: Zen 3, Haswell and later). A worker's --cpu-isa (settings/fast_paths.py) names a ceiling: the
best set up to it that this CPU has, so that one config serves every machine and an AMX machine can test the
AVX-512 and AVX2 kernels (`auto`: the best there is). `None`: no set the kernels need (torch's matmuls run).
"""

from __future__ import annotations

import functools
import logging

from kernels.cpu_features import cpu_flags_line

logger = logging.getLogger(__name__)

# What each set needs in /proc/cpuinfo's flags, best first.
REQUIRED = {
    "amx": frozenset({"amx_tile", "amx_bf16", "avx512_bf16"}),
    "avx512_bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}
ISAS = tuple(REQUIRED)
CHOICES = ("auto", *ISAS)  # settings/fast_paths.py CPU_ISAS: the same
# The compiler flags of vector_gemm_cpu.c's build for each set (not -march=native: the build must be the set asked
# for, below the machine's best). Not -ffast-math: the sums keep their order (batch invariance).
VECTOR_FLAGS = {
    "avx512_bf16": ("-O3", "-march=x86-64-v4", "-mavx512bf16", "-mtune=native", "-fopenmp", "-fPIC"),
    "avx2": ("-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp", "-fPIC"),
}
_ceiling = ["auto"]


def has(isa: str, flags_line: str | None = None) -> bool:
    """Whether this CPU (or the flags line given) has what `isa`'s kernels need."""
    line = cpu_flags_line() if flags_line is None else flags_line
    return REQUIRED[isa] <= set(line.partition(":")[2].split())


def best(ceiling: str = "auto", flags_line: str | None = None) -> str | None:
    """The best set up to `ceiling` that the CPU has; None where it has none of them."""
    if ceiling not in CHOICES:
        raise ValueError(f"cpu_isa must be one of {', '.join(CHOICES)}, not {ceiling!r}")
    allowed = ISAS if ceiling == "auto" else ISAS[ISAS.index(ceiling) :]
    return next((isa for isa in allowed if has(isa, flags_line)), None)


def set_ceiling(ceiling: str) -> None:
    """The worker's --cpu-isa, for what is loaded next (kernels/cpu_gemm.py asks `current` as it loads)."""
    best(ceiling)  # checks the name
    _ceiling[0] = ceiling


def current() -> str | None:
    """The set the kernels use now (logged once per choice)."""
    return _chosen(_ceiling[0])


@functools.cache
def _chosen(ceiling: str) -> str | None:
    isa = best(ceiling)
    logger.info("CPU matmul kernels: %s (--cpu-isa %s)", isa or "none, torch's matmuls", ceiling)
    return isa
