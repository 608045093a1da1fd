"""The flags of vllm-worker, shared with vllm-serve (which forwards them to the workers it starts)."""

from __future__ import annotations

import argparse

WORKER_FLAGS = (
    "device",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "attention_backend",
    "connect_timeout",
    "threads",
)


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '1e9' or a plain byte count."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = str(text).strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(float(lowered))


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda, cuda:N")
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="bytes for the KV cache, e.g. 4GiB (default: a quarter of free RAM on CPU; "
        "--gpu-memory-utilization on GPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory the worker may fill, model and KV cache together",
    )
    p.add_argument(
        "--attention-backend",
        choices=("auto", "triton", "torch"),
        default="auto",
        help="auto: triton on CUDA, torch on CPU",
    )
    p.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the scheduler")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command-line form of the worker flags in `args` (those not left at None)."""
    argv = []
    for name in WORKER_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
