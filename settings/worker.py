"""A worker's own settings (its flags; what it serves comes from the scheduler's Assignment), and how vllm-serve
and `LLM` hand them to the worker processes they start."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from proto.attention_setting import BUILT_IN, parse_setting
from settings.build import flat_values
from settings.cli import Part, to_argv
from settings.fast_paths import FastPaths
from settings.setting import check, group, setting
from settings.units import parse_gib, parse_size

__all__ = ["parse_size"]  # where scripts and tests have imported it from (defined in settings/units.py)

# A worker that exits with this status was started with flags it cannot run with (argparse's own status): starting
# it again cannot help, so a supervisor gives up instead of restarting it forever.
EXIT_BAD_FLAGS = 2
ATTENTION_BACKENDS = BUILT_IN
# kernels/kv_quant.py: the formats behind int8 and fp8_e4m3; a float names the full-precision cache's own dtype
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "float16", "bfloat16", "float32")
OVERLAP_CHOICES = ("auto", "on", "off")
KV_ROLES = ("prefill", "decode", "both")
KV_TRANSFER_MODES = ("auto", "tcp")


def attention_backend(text: str) -> str:
    """A built-in backend name, `module:Class`, or a compiled kernel with its library (`NAME=PATH.so` or the JSON
    form, proto/attention_setting.py): what the worker, which may run elsewhere, loads. A bare kernel name is
    refused: no process that parses flags has registered one."""
    choice = parse_setting(text)  # ValueError naming what is wrong
    if choice.compiled and not choice.library:
        raise ValueError(
            f"expected one of {', '.join(ATTENTION_BACKENDS)}, module:Class or NAME=PATH.so (a compiled kernel), "
            f"got {text!r}"
        )
    return text


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """A worker: its device and memory, its kernels, its KV tiers and transfers."""

    scheduler_address: str = setting(
        "127.0.0.1:50061",
        readers="worker",
        help="HOST:PORT of the scheduler: its workers' socket (--worker-host:--worker-port), or its gRPC port "
        "(--host:--port, cleartext), which names that socket (worker_node/join_address.py)",
    )
    device: str = setting("auto", readers="worker", help="auto (cuda if present, else cpu), cpu, cuda, cuda:N")
    kv_cache_memory: int | None = setting(
        None,
        parse=parse_size,
        readers="worker",
        help="bytes for the KV cache, e.g. 4GiB (default: a quarter of free RAM on CPU, split between the ranks of "
        "the world on this host; --gpu-memory-utilization on GPU)",
    )
    encoder_cache_memory: int = setting(
        256 * 2**20,
        parse=parse_size,
        low=0,
        readers="worker",
        help="bytes of a multimodal model's encoder outputs each worker keeps by image (a repeated image is not "
        "encoded again; least recently used out first), e.g. 256MiB",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        above=0,
        high=1,
        readers="worker",
        help="fraction of GPU memory the worker may fill, model and KV cache together",
    )
    attention_backend: str = setting(
        "auto",
        parse=attention_backend,
        readers="worker",
        help="auto: triton on CUDA; on CPU native (a C kernel built once with the system compiler), torch if "
        "it cannot be built; or module:Class, your own backend (example: deploy/custom_attention.py); or "
        "NAME=PATH.so, your compiled kernel (kernels/csrc/custom_attention_abi.h, example: "
        "deploy/custom_attention_kernel.c)",
    )
    connect_timeout: float = setting(60.0, above=0, readers="worker", help="seconds to wait for the scheduler")
    threads: int = setting(0, low=0, readers="worker", help="torch CPU threads (0: torch's default)")
    swap_space: float = setting(
        4.0,
        low=0,
        parse=parse_gib,
        readers="worker",
        help="GiB of host memory per worker for swapped-out KV blocks (preemption by swap), or a size with its unit "
        "(8GB); 0 disables swap",
    )
    zmq_curve_dir: str | None = setting(
        None,
        metavar="DIR",
        readers=("scheduler", "worker"),
        help="encrypt and authenticate the scheduler-worker socket with ZMQ CURVE keys kept in DIR "
        "(the scheduler creates them when missing; copy DIR to worker hosts); default: plain TCP",
    )
    local_address: str = setting(
        "",
        readers="worker",
        help="this worker's IP on a multi-host world: its connection to the scheduler leaves from it, the "
        "scheduler hands it out as the rendezvous address when this worker is rank 0, and torch.distributed "
        "(gloo) binds to it (default: chosen by the OS)",
    )
    cuda_graph_sizes: str = setting(
        "",
        readers="worker",
        help="decode batch sizes to capture as CUDA graphs, e.g. 1,2,4,8,16,32 (batches pad up to the nearest); "
        "GPU with the triton backend and TP 1 only; empty: run eagerly (the default, and always on CPU)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        readers="worker",
        help="how the KV cache stores keys and values: auto (the model's dtype, the default), or int8 / fp8_e4m3 "
        "with one float32 scale per token and KV head (about 1.9x the blocks of a bf16 cache, 3.8x of fp32, "
        "at head_dim 64; fp8 with triton needs compute capability 8.9+), or a float other than the model's "
        "(float16 under a bfloat16 model: K/V are cast when written, queries when read; native reads "
        "float32/bfloat16 only)",
    )
    kv_offload_ram: float = setting(
        0.0,
        low=0,
        parse=parse_gib,
        metavar="GIB",
        readers="worker",
        help="GiB (or a size with its unit, 20GB) of host RAM per worker that keeps prefix blocks evicted from the "
        "device KV cache; a later "
        "request with that prefix loads them back instead of recomputing them (0: no RAM tier)",
    )
    kv_offload_disk: str = setting(
        "",
        metavar="DIR",
        readers="worker",
        help="folder for the disk KV tier (blocks evicted from the RAM tier, or from the device without one); "
        "one file per rank that survives a restart, with a checksum per block and the model, dtype and layout "
        "in its header (a file that does not match is ignored and started afresh). It must be a folder this "
        "process can write in (created if missing): anything else is refused at start. A disk that fills up "
        "turns the tier off (a failed write drops its block, never a request)",
    )
    kv_offload_disk_size: float = setting(
        4.0,
        low=0,
        parse=parse_gib,
        metavar="GIB",
        readers="worker",
        help="GiB of the disk KV tier's file per worker (with --kv-offload-disk), or a size with its unit (20GB, "
        "512MiB); a worker warns at start when its filesystem has less free",
    )
    kv_role: str = setting(
        "both",
        choices=KV_ROLES,
        readers="worker",
        help="disaggregated prefill/decode (vllm-router --disaggregate): prefill and both serve the KV of finished "
        "prefills to other replicas' workers (a ZeroMQ socket per rank, CURVE with --zmq-curve-dir); decode "
        "serves none; every role pulls",
    )
    kv_transfer_host: str = setting(
        "127.0.0.1",
        readers="worker",
        help="the address a rank's KV exporter binds (a free port; reported to the scheduler); other hosts' decode "
        "workers must reach it",
    )
    kv_transfer_mode: str = setting(
        "auto",
        choices=KV_TRANSFER_MODES,
        readers="worker",
        help="auto: KV pulls between processes of one host go through a staging buffer (/dev/shm on CPU, CUDA IPC "
        "on GPU), other hosts' by frames over the KV socket; tcp: always frames (either side may choose it)",
    )
    batch_invariant: bool = setting(
        False,
        readers="worker",
        help="every dense product and the LM head in fixed-size row chunks, so a sequence's logits, and a seeded "
        "stream's draws, do not depend on what shares its batch (a migration, other arrivals); CPU; costs "
        "decode throughput at few sequences (docs/guide.md)",
    )
    overlap_steps: str = setting(
        "auto",
        choices=OVERLAP_CHOICES,
        readers="worker",
        help="launch the next plan before this step's sampled tokens reach the host, its decodes reading them on "
        "the device (steps whose rows need no logits processor or logprobs): the GPU no longer waits for the "
        "host's part of each step. auto (the default): on for CUDA devices; on a CPU a step computes while it is "
        "launched, so overlapping only delays its result",
    )
    fast_paths: FastPaths = group(FastPaths)

    def __post_init__(self) -> None:
        check(self)


# What vllm-serve and `LLM` hand the workers they start: every worker setting but where to join (they say that).
HANDED_ON = (Part(WorkerOptions, skip=("scheduler_address",)),)


def worker_argv(settings: argparse.Namespace | WorkerOptions) -> list[str]:
    """The command-line form of the worker settings in `settings` (a command line, or a worker's settings) that
    differ from their defaults."""
    values = vars(settings) if isinstance(settings, argparse.Namespace) else flat_values(settings)
    return to_argv(HANDED_ON, values, changed_only=True)


def offload_dir_problem(folder: str, name: str = "--kv-offload-disk") -> str:
    """Why the disk KV tier cannot live in `folder`, in one line starting with `name` ("" when it can): it must
    be a folder this process can create files in (created when missing). Tried, not inferred from permission
    bits, which a read-only mount, or root, would make lie."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"{name} {folder}: not a folder"
    except OSError as exc:
        return f"{name} {folder}: cannot create it ({exc.strerror or exc})"
    if not path.is_dir():
        return f"{name} {folder}: not a folder"
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{name} {folder}: cannot write in it ({exc.strerror or exc})"
    return ""
