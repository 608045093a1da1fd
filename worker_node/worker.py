"""vllm-worker: connect to the scheduler, load the model shard, size the KV cache, then run plans forever."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

import torch
import zmq

from kernels.backend import select_attention_backend
from proto.cli_config import add_config_flag, parse_args
from proto.wire import (
    MAX_MESSAGE_BYTES,
    Assignment,
    Message,
    Shutdown,
    StepPlan,
    WireError,
    WorkerHello,
    WorkerReady,
    decode,
    encode,
)
from proto.worker_flags import add_worker_flags
from worker_node.kv_cache import allocate_kv_cache, bytes_per_block, kv_cache_budget
from worker_node.model_runner import ModelRunner
from worker_node.models.config import ModelConfig
from worker_node.models.loader import load_model

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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class Worker:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.device = pick_device(options.device)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{options.scheduler_address}")
        self.runner: ModelRunner | None = None

    def run(self) -> int:
        self._send(WorkerHello(socket.gethostname(), os.getpid(), str(self.device)))
        assignment = self._recv(self.options.connect_timeout)
        if not isinstance(assignment, Assignment):
            logger.error("no assignment from the scheduler at %s", self.options.scheduler_address)
            return 1
        ready = self._load(assignment)
        self._send(ready)
        logger.info("rank %d ready with %d KV blocks", assignment.rank, ready.num_kv_blocks)
        while True:
            message = self._recv(None)
            if isinstance(message, Shutdown):
                logger.info("shutting down: %s", message.reason)
                return 0
            if isinstance(message, StepPlan) and self.runner is not None:
                self._send(self.runner.execute(message))

    def _load(self, a: Assignment) -> WorkerReady:
        dtype = pick_dtype(a.dtype, self.device)
        config = ModelConfig.from_folder(a.model)
        backend = select_attention_backend(self.options.attention_backend, self.device)
        model = load_model(a.model, backend, dtype, self.device, config.max_model_len)
        budget = kv_cache_budget(self.device, self.options.kv_cache_memory, self.options.gpu_memory_utilization)
        cache = allocate_kv_cache(config, a.block_size, dtype, self.device, budget)
        self.runner = ModelRunner(model, cache, a.block_size, self.device)
        num_blocks = cache[0][0].shape[0]
        return WorkerReady(a.rank, num_blocks, num_blocks * bytes_per_block(config, a.block_size, dtype))

    def _send(self, message: Message) -> None:
        self._sock.send(encode(message))

    def _recv(self, timeout: float | None) -> Message | None:
        while True:
            if timeout is not None and not self._sock.poll(int(timeout * 1000)):
                return None
            try:
                return decode(self._sock.recv())
            except WireError as exc:
                logger.warning("dropped a malformed message: %s", exc)

    def close(self) -> None:
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
    )
    signal.signal(signal.SIGTERM, _exit_cleanly)
    worker = Worker(options)
    try:
        return worker.run()
    except (KeyboardInterrupt, SystemExit):
        logger.info("stopped by signal")
        return 0
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
