"""The flags of vllm-worker, shared with vllm-serve (which forwards them to the workers it starts)."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from proto.attention_setting import BUILT_IN, parse_setting

# A worker that exits with this status was started with flags it cannot run with (argparse's own status): starting
# it again cannot help, so a supervisor gives up instead of restarting it forever.
EXIT_BAD_FLAGS = 2


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """A worker's own settings (its flags); what it serves comes from the scheduler's Assignment."""

    scheduler_address: str = ""
    device: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    connect_timeout: float = 60.0
    threads: int = 0
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    zmq_curve_dir: str | None = None  # CURVE keys (proto/curve.py); None: plain TCP
    local_address: str = ""  # this worker's IP: its ZMQ connection leaves from it, torch.distributed binds it
    cuda_graph_sizes: str = ""  # decode batch sizes captured as CUDA graphs ("" : eager)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), int8 or fp8_e4m3 (kernels/kv_quant.py)
    kv_offload_ram: float = 0.0  # GiB of host RAM for evicted prefix blocks (the RAM offload tier)
    kv_offload_disk: str = ""  # folder of the disk offload tier ("" : none)
    kv_offload_disk_size: float = 4.0  # GiB of that folder's file
    kv_role: str = "both"  # disaggregated prefill/decode: prefill and both serve KV leases; every role pulls
    kv_transfer_host: str = "127.0.0.1"  # where a serving rank's KV exporter binds (a free port)
    kv_transfer_mode: str = "auto"  # auto: a staging buffer between processes of one host, else frames; tcp: frames
    batch_invariant: bool = False  # dense products in fixed-size row chunks: a row's bits independent of its batch
    overlap_steps: str = "auto"  # launch the next plan before a step's tokens reach the host (auto: on CUDA)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerOptions:
        """A worker's settings from its command line; flags left at None keep the defaults."""
        given = {name: getattr(args, name) for name in (*WORKER_FLAGS, "scheduler_address", "zmq_curve_dir")}
        return cls(**{name: value for name, value in given.items() if value is not None})


DEFAULTS = WorkerOptions()  # the flags' defaults

WORKER_FLAGS = (
    "device",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "swap_space",
    "attention_backend",
    "connect_timeout",
    "threads",
    "local_address",
    "cuda_graph_sizes",
    "kv_cache_dtype",
    "kv_offload_ram",
    "kv_offload_disk",
    "kv_offload_disk_size",
    "kv_role",
    "kv_transfer_host",
    "kv_transfer_mode",
    "batch_invariant",
    "overlap_steps",
)
OVERLAP_CHOICES = ("auto", "on", "off")
KV_ROLES = ("prefill", "decode", "both")
KV_TRANSFER_MODES = ("auto", "tcp")


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '1e9' or a plain byte count."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = str(text).strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(float(lowered))


ATTENTION_BACKENDS = BUILT_IN
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # kernels/kv_quant.py: the formats behind the last two


def _attention_backend(text: str) -> str:
    """A built-in backend name, `module:Class`, or a compiled kernel with its library (`NAME=PATH.so` or the JSON
    form, proto/attention_setting.py): what the worker, which may run elsewhere, loads. A bare kernel name is
    refused: no process that parses flags has registered one."""
    try:
        choice = parse_setting(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if choice.compiled and not choice.library:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(ATTENTION_BACKENDS)}, module:Class or NAME=PATH.so (a compiled kernel), "
            f"got {text!r}"
        )
    return text


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=DEFAULTS.device, help="auto (cuda if present, else cpu), cpu, cuda, cuda:N")
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="bytes for the KV cache, e.g. 4GiB (default: a quarter of free RAM on CPU, split between the ranks of "
        "the world on this host; "
        "--gpu-memory-utilization on GPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULTS.gpu_memory_utilization,
        help="fraction of GPU memory the worker may fill, model and KV cache together",
    )
    p.add_argument(
        "--attention-backend",
        type=_attention_backend,
        default=DEFAULTS.attention_backend,
        help="auto: triton on CUDA; on CPU native (a C kernel built once with the system compiler), torch if "
        "it cannot be built; or module:Class, your own backend (example: deploy/custom_attention.py); or "
        "NAME=PATH.so, your compiled kernel (kernels/csrc/custom_attention_abi.h, example: "
        "deploy/custom_attention_kernel.c)",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=DEFAULTS.swap_space,
        help="GiB of host memory per worker for swapped-out KV blocks (preemption by swap); 0 disables swap",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=DEFAULTS.connect_timeout, help="seconds to wait for the scheduler"
    )
    p.add_argument("--threads", type=int, default=DEFAULTS.threads, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--local-address",
        default=None,
        help="this worker's IP on a multi-host world: its connection to the scheduler leaves from it, the "
        "scheduler hands it out as the rendezvous address when this worker is rank 0, and torch.distributed "
        "(gloo) binds to it (default: chosen by the OS)",
    )
    p.add_argument(
        "--cuda-graph-sizes",
        default=None,
        help="decode batch sizes to capture as CUDA graphs, e.g. 1,2,4,8,16,32 (batches pad up to the nearest); "
        "GPU with the triton backend and TP 1 only; empty: run eagerly (the default, and always on CPU)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=DEFAULTS.kv_cache_dtype,
        help="how the KV cache stores keys and values: auto (the model's dtype, the default), or int8 / fp8_e4m3 "
        "with one float32 scale per token and KV head (about 1.9x the blocks of a bf16 cache, 3.8x of fp32, "
        "at head_dim 64; fp8 with triton needs compute capability 8.9+)",
    )

    p.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="every dense product and the LM head in fixed-size row chunks, so a sequence's logits, and a seeded "
        "stream's draws, do not depend on what shares its batch (a migration, other arrivals); CPU; costs "
        "decode throughput at few sequences (docs/guide.md)",
    )
    p.add_argument(
        "--overlap-steps",
        choices=OVERLAP_CHOICES,
        default=DEFAULTS.overlap_steps,
        help="launch the next plan before this step's sampled tokens reach the host, its decodes reading them on "
        "the device (steps whose rows need no logits processor or logprobs): the GPU no longer waits for the "
        "host's part of each step. auto (the default): on for CUDA devices; on a CPU a step computes while it is "
        "launched, so overlapping only delays its result",
    )
    add_kv_offload_flags(p)


def add_kv_offload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-offload-ram",
        type=float,
        default=DEFAULTS.kv_offload_ram,
        metavar="GIB",
        help="GiB of host RAM per worker that keeps prefix blocks evicted from the device KV cache; a later "
        "request with that prefix loads them back instead of recomputing them (0: no RAM tier)",
    )
    p.add_argument(
        "--kv-offload-disk",
        default=None,
        metavar="DIR",
        help="folder for the disk KV tier (blocks evicted from the RAM tier, or from the device without one); "
        "one file per rank that survives a restart, with a checksum per block and the model, dtype and layout "
        "in its header (a file that does not match is ignored and started afresh). It must be a folder this "
        "process can write in (created if missing): anything else is refused at start. A disk that fills up "
        "turns the tier off (a failed write drops its block, never a request)",
    )
    p.add_argument(
        "--kv-offload-disk-size",
        type=float,
        default=DEFAULTS.kv_offload_disk_size,
        metavar="GIB",
        help="GiB of the disk KV tier's file per worker (with --kv-offload-disk); a worker warns at start when "
        "its filesystem has less free",
    )
    p.add_argument(
        "--kv-role",
        choices=KV_ROLES,
        default=DEFAULTS.kv_role,
        help="disaggregated prefill/decode (vllm-router --disaggregate): prefill and both serve the KV of finished "
        "prefills to other replicas' workers (a ZeroMQ socket per rank, CURVE with --zmq-curve-dir); decode "
        "serves none; every role pulls",
    )
    p.add_argument(
        "--kv-transfer-host",
        default=DEFAULTS.kv_transfer_host,
        help="the address a rank's KV exporter binds (a free port; reported to the scheduler); other hosts' decode "
        "workers must reach it",
    )
    p.add_argument(
        "--kv-transfer-mode",
        choices=KV_TRANSFER_MODES,
        default=DEFAULTS.kv_transfer_mode,
        help="auto: KV pulls between processes of one host go through a staging buffer (/dev/shm on CPU, CUDA IPC "
        "on GPU), other hosts' by frames over the KV socket; tcp: always frames (either side may choose it)",
    )


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


def add_curve_flag(p: argparse.ArgumentParser) -> None:
    """--zmq-curve-dir: on the scheduler and on every worker (vllm-serve passes it to both)."""
    p.add_argument(
        "--zmq-curve-dir",
        default=None,
        metavar="DIR",
        help="encrypt and authenticate the scheduler-worker socket with ZMQ CURVE keys kept in DIR "
        "(the scheduler creates them when missing; copy DIR to worker hosts); default: plain TCP",
    )


def worker_argv(settings: argparse.Namespace | WorkerOptions) -> list[str]:
    """The command-line form of the worker flags in `settings` (a command line, or a worker's settings): those
    set, not None or empty."""
    argv = []
    for name in WORKER_FLAGS:
        value, flag = getattr(settings, name), f"--{name.replace('_', '-')}"
        if value is True:  # a switch
            argv.append(flag)
        elif value is not None and value is not False and value != "":
            argv += [flag, str(value)]
    return argv
