"""vllm-worker: connect to the scheduler, load the model shard, size the KV cache, then run plans forever."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass

import torch
import zmq

from kernels.backend import select_attention_backend
from kernels.cpu_features import has_fast_bf16
from proto.cli_config import add_config_flag, parse_args
from proto.curve import CurveError, configure_client
from proto.parallel import ParallelLayout, kv_head_range
from proto.wire import (
    MAX_MESSAGE_BYTES,
    Assignment,
    Message,
    Shutdown,
    WorkerHello,
    WorkerReady,
    encode,
)
from proto.worker_flags import add_curve_flag, add_worker_flags
from worker_node.cuda_graphs import enable_decode_graphs
from worker_node.kv_cache import (
    allocate_host_cache,
    allocate_kv_cache,
    bytes_per_block,
    kv_cache_budget,
    measure_swap_bandwidth,
)
from worker_node.model_runner import ModelRunner
from worker_node.models.config import ModelConfig
from worker_node.models.loader import load_model
from worker_node.parallel import Comm, ParallelRank, RendezvousAborted, connect
from worker_node.plan_loop import PlanLoop, decode_or_none

logger = logging.getLogger("vllm-worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    scheduler_address: str
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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on GPUs and on CPUs with bf16 dot-product instructions (AVX-512 BF16, AMX), float32 on
    other CPUs.

    No float32 copy of the weights is kept for small steps: on a 2-core Zen 4 one decoder layer's linears ran
    1.04x (1 row) to 2.5x (16-32 rows) faster in bf16 than in float32 with one thread, 1.5-3.2x with two, and
    the LM head 1.5-3.7x (scripts/bench_cpu_dtypes.py, README)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or has_fast_bf16() else torch.float32
    return DTYPES[name]


class Worker:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.device = pick_device(options.device)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A stable identity: after a network blip the scheduler still knows who this is.
        identity = f"{socket.gethostname()[:64]}/{os.getpid()}/{secrets.token_hex(4)}"
        self._sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        if options.zmq_curve_dir:
            configure_client(self._sock, options.zmq_curve_dir)
        source = f"{options.local_address}:0;" if options.local_address else ""
        self._sock.connect(f"tcp://{source}{options.scheduler_address}")
        self.runner: ModelRunner | None = None
        self.comm: Comm | None = None
        self._rendezvous_monitor: zmq.Socket | None = None

    def run(self) -> int:
        self._send(WorkerHello(socket.gethostname(), os.getpid(), str(self.device)))
        assignment = self._await_assignment()
        if not isinstance(assignment, Assignment):
            return 0 if isinstance(assignment, Shutdown) else 1
        try:
            ready = self._load(assignment)
        except RendezvousAborted as exc:
            logger.warning("left the torch.distributed rendezvous: %s", exc)
            return 0
        self._send(ready)
        logger.info("rank %d ready with %d KV blocks", assignment.rank, ready.num_kv_blocks)
        runner = self.runner
        assert runner is not None
        loop = PlanLoop(
            self._sock,
            assignment.rank,
            runner.execute,
            self.options.connect_timeout,
            self._thread_setup,
            runner.interrupts.add,
        )
        return loop.run()

    def _await_assignment(self) -> Assignment | Shutdown | None:
        """The scheduler's Assignment; Shutdown when it turned us away; None when it never answered."""
        deadline = time.monotonic() + self.options.connect_timeout
        while (left := deadline - time.monotonic()) > 0:
            message = self._recv(left)
            if isinstance(message, Assignment):
                return message
            if isinstance(message, Shutdown):
                logger.info("the scheduler turned this worker away: %s", message.reason)
                return message
            if message is not None:
                logger.warning("ignoring %s before the assignment", type(message).__name__)
        logger.error("no assignment from the scheduler at %s", self.options.scheduler_address)
        return None

    def _thread_setup(self) -> None:
        """Runs on the step thread before its first plan: the CUDA device and OpenMP's thread count are per thread."""
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _load(self, a: Assignment) -> WorkerReady:
        if a.device:
            self.device = torch.device(a.device)  # the scheduler's placement wins
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = pick_dtype(a.dtype, self.device)
        where = ParallelRank(ParallelLayout(a.tensor_parallel_size, a.pipeline_parallel_size), a.rank)
        full = ModelConfig.from_folder(a.model)
        config = shard_config(full, where)  # what this rank's KV cache holds: its layers, its KV heads
        backend = select_attention_backend(self.options.attention_backend, self.device)
        try:
            self.comm = connect(
                where, a.distributed_init, self.options.local_address, self.device, a.distributed_timeout_s, self._gone
            )
        finally:
            if self._rendezvous_monitor is not None:
                self._sock.disable_monitor()
                self._rendezvous_monitor.close(linger=0)
                self._rendezvous_monitor = None
        model = load_model(a.model, backend, dtype, self.device, full.max_model_len, where, self.comm)
        budget = kv_cache_budget(self.device, self.options.kv_cache_memory, self.options.gpu_memory_utilization)
        cache = allocate_kv_cache(config, a.block_size, dtype, self.device, budget)
        block_bytes = bytes_per_block(config, a.block_size, dtype)
        host = allocate_host_cache(config, a.block_size, dtype, self.device, int(self.options.swap_space * 2**30))
        self.runner = ModelRunner(model, cache, a.block_size, self.device, host, self.comm)
        enable_decode_graphs(self.runner, self.options.cuda_graph_sizes, backend.name, full.max_model_len)
        num_blocks = cache[0][0].shape[0]
        bandwidth = measure_swap_bandwidth(cache, host, block_bytes)
        return WorkerReady(a.rank, num_blocks, num_blocks * block_bytes, host[0][0].shape[0], bandwidth)

    def _send(self, message: Message) -> None:
        self._sock.send(encode(message))

    def _gone(self) -> str:
        """Why to stop waiting for the world (Shutdown from the scheduler, or its connection dropped), or ""."""
        if self._rendezvous_monitor is None:  # events from now on: the connection is up (the assignment came)
            self._rendezvous_monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if self._rendezvous_monitor.poll(0):
            return "the scheduler's connection dropped"
        message = self._recv(0.0)  # before the Ready, only a Shutdown is expected
        return message.reason if isinstance(message, Shutdown) else ""

    def _recv(self, timeout: float) -> Message | None:
        """The next message within `timeout` seconds; None on timeout or when it was malformed (dropped)."""
        if not self._sock.poll(max(1, int(timeout * 1000))):
            return None
        return decode_or_none(self._sock.recv())

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
        self._sock.close(linger=0)
        self._ctx.term()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-worker",
        description="Run one model shard: connects to vllm-scheduler, receives step plans over ZMQ, "
        "runs the model on its device and returns sampled tokens.",
    )
    add_config_flag(p)
    p.add_argument("--scheduler-address", default="127.0.0.1:50061", help="HOST:PORT of the scheduler's worker socket")
    add_worker_flags(p)
    add_curve_flag(p)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    return p


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    options = WorkerOptions(
        args.scheduler_address,
        args.device,
        args.kv_cache_memory,
        args.gpu_memory_utilization,
        args.attention_backend,
        args.connect_timeout,
        args.threads,
        args.swap_space,
        args.zmq_curve_dir,
        local_address=args.local_address or "",
        cuda_graph_sizes=args.cuda_graph_sizes or "",
    )
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        worker = Worker(options)
    except CurveError as exc:
        logger.error("%s", exc)
        return 2
    try:
        return worker.run()
    except (KeyboardInterrupt, SystemExit):
        logger.info("stopped by signal")
        return 0
    finally:
        worker.close()


def shard_config(config: ModelConfig, where: ParallelRank) -> ModelConfig:
    """The model as one rank holds it: its stage's layers and its KV heads (what its KV cache is sized for)."""
    start, end = where.layout.layer_range(where.stage, config.num_layers)
    kv0, kv1 = kv_head_range(config.num_kv_heads, where.tp_size, where.tp_rank)
    return dataclasses.replace(config, num_layers=end - start, num_kv_heads=kv1 - kv0)


if __name__ == "__main__":
    sys.exit(main())
