"""The CPU fast paths' switches: each on by default, each with the environment variable that turned it off before
it was a setting (still read, where settings are read: a worker's start, `LLM(...)`). They exist to compare a fast
path against what it replaces (scripts/bench_*.py, the fidelity tests), and to time one (--decode-phases).

A worker applies them once as a rank loads (worker_node/loading.py): `native_decode`, `decode_phases` and
`huge_pages` are handed to the model; `cpu_gemm` and `int8_act_bits` set module-level switches of the kernels
(kernels/cpu_gemm.py, worker_node/models/quant_int8.py), which are consulted deep in the layers' weight packing
and products, far from any settings object.
"""

from __future__ import annotations

from dataclasses import dataclass

from settings.setting import check, setting

# kernels/cpu_isa.py's choices (kept here too: settings import no kernels), best last but for auto.
CPU_ISAS = ("auto", "amx", "avx512_bf16", "avx2")

ACT_BITS = (8, 16)  # what the AMX-INT8 kernel can quantize activations to (kernels/cpu_gemm.py linear_int8_act)
INT8_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def act_bits_overrides(text: str) -> dict[str, int]:
    """`--int8-act-bits` as {projection: bits}: "8" (every projection) or "qkv_proj=8,down_proj=16"; ValueError
    naming the entry that is neither."""
    bits: dict[str, int] = {}
    for entry in filter(None, str(text).split(",")):
        role, _, value = entry.strip().rpartition("=")
        if not value.isdigit() or int(value) not in ACT_BITS or (role and role not in INT8_PROJECTIONS):
            raise ValueError(
                f"int8_act_bits: {entry!r} is not BITS or PROJECTION=BITS (bits 8 or 16, projections "
                f"{', '.join(INT8_PROJECTIONS)})"
            )
        bits.update({r: int(value) for r in ([role] if role else INT8_PROJECTIONS)})
    return bits


def _act_bits_text(text: str) -> str:
    act_bits_overrides(text)
    return text


@dataclass(frozen=True, slots=True)
class FastPaths:
    """The CPU fast paths: each on unless told off, to compare or to time it."""

    cpu_gemm: bool = setting(
        True,
        env="MINIVLLM_CPU_GEMM",
        readers="worker",
        help="the C matmul kernels for decode-sized products on CPU (kernels/cpu_gemm.py: AMX; "
        "kernels/cpu_gemm_portable.py; kernels/cpu_gemm_awq.py); --no-cpu-gemm: torch's matmuls only (to compare)",
    )
    cpu_isa: str = setting(
        "auto",
        choices=CPU_ISAS,
        env="MINIVLLM_CPU_ISA",
        readers="worker",
        help="the best instruction set the CPU matmul kernels may use (kernels/cpu_isa.py): amx, avx512_bf16 "
        "(VDPBF16PS) or avx2 (+FMA); the best this CPU has up to it; auto: the best it has (logged at start)",
    )
    native_decode: bool = setting(
        True,
        env="MINIVLLM_NATIVE_DECODE",
        readers="worker",
        help="run a CPU decode step's layers in one C call where they qualify (worker_node/models/native_decode.py); "
        "--no-native-decode: the Python layers (to compare)",
    )
    decode_phases: bool = setting(
        False,
        env="MINIVLLM_DECODE_PHASES",
        readers="worker",
        help="the C decode runner times each phase of a layer (scripts/bench_decode_phases.py prints them); two "
        "clock reads per phase, so off by default",
    )
    huge_pages: bool = setting(
        True,
        env="MINIVLLM_HUGE_PAGES",
        readers="worker",
        help="collapse a CPU model's weights onto transparent huge pages once loaded "
        "(worker_node/runtime/huge_pages.py); advice the kernel may refuse",
    )
    int8_act_bits: str = setting(
        "",
        parse=_act_bits_text,
        env="MINIVLLM_INT8_ACT_BITS",
        readers="worker",
        help="int8 weights on the AMX-INT8 kernel: activation bits per projection instead of 16 (about bf16's "
        "precision), to compare: 8 (W8A8 everywhere) or e.g. qkv_proj=8,down_proj=16 (empty: 16 everywhere)",
    )

    def __post_init__(self) -> None:
        check(self)
        act_bits_overrides(self.int8_act_bits)
