"""vllm-worker: connect to the scheduler, load the model shard, size the KV cache, then run plans forever."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import zmq

from proto.curve import CurveError, configure_client
from proto.drop_log import DropLog
from proto.liveness import Beats
from proto.parallel import ParallelLayout
from proto.wire import (
    HEARTBEAT_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    ZMQ_HEARTBEAT_IVL_MS,
    Assignment,
    Message,
    Shutdown,
    WorkerHello,
    WorkerReady,
    encode,
)
from settings.cli import from_args
from settings.commands import command_parser
from settings.config_file import parse_args
from settings.worker import EXIT_BAD_FLAGS, WorkerOptions, offload_dir_problem
from worker_node.join_address import JoinAddressError, join_address
from worker_node.kv.handoff import make_handoff
from worker_node.loading import load_rank, pick_device
from worker_node.model_runner import ModelRunner
from worker_node.plan_loop import PlanLoop, decode_or_none
from worker_node.runtime.parallel import Comm, ParallelRank, RendezvousAborted, connect

logger = logging.getLogger("vllm-worker")


@dataclass(frozen=True, slots=True)
class Serves:
    """What a worker started with --model says it serves (its Hello): the model, and the world's shape. Empty: it
    serves whatever the scheduler assigns."""

    model: str = ""
    tensor_parallel_size: int = 0
    pipeline_parallel_size: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Serves:
        model = getattr(args, "model", "")
        if not model:
            return cls()
        local = Path(model).expanduser()  # a folder here: named absolutely (the scheduler runs elsewhere)
        named = str(local.resolve()) if local.exists() else model
        return cls(named, args.tensor_parallel_size, args.pipeline_parallel_size)


class Worker:
    def __init__(self, options: WorkerOptions, beats: Beats | None = None, serves: Serves = Serves()) -> None:
        self.options = options
        self.serves = serves
        self.beats = beats or Beats()
        self.device = pick_device(options.device)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A stable identity: after a network blip the scheduler still knows who this is.
        identity = f"{socket.gethostname()[:64]}/{os.getpid()}/{secrets.token_hex(4)}"
        self._sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        # libzmq's own PINGs, answered by the scheduler's libzmq I/O thread: the connection stays up while the
        # scheduler's event loop is busy, and drops this long after the scheduler process stopped answering.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        if options.zmq_curve_dir:
            configure_client(self._sock, options.zmq_curve_dir)
        source = f"{options.local_address}:0;" if options.local_address else ""
        # The scheduler's gRPC address names the workers' socket; that socket's own address is kept as it is.
        self.address = join_address(options.scheduler_address, options.connect_timeout, options.local_address)
        if self.address != options.scheduler_address:
            logger.info("the scheduler at %s says workers join at %s", options.scheduler_address, self.address)
        self._sock.connect(f"tcp://{source}{self.address}")
        self.runner: ModelRunner | None = None
        self.comm: Comm | None = None
        self._rendezvous_monitor: zmq.Socket | None = None
        self.drops = DropLog("scheduler", logger)  # what the socket dropped, before and after the assignment

    def run(self) -> int:
        s = self.serves
        hello = WorkerHello(socket.gethostname(), os.getpid(), str(self.device), s.model, s.tensor_parallel_size,
                            s.pipeline_parallel_size)  # fmt: skip
        self._send(hello)
        assignment = self._await_assignment()
        if isinstance(assignment, Shutdown):  # refused for what it is: starting it again as it is cannot help
            return EXIT_BAD_FLAGS if assignment.refused else 0
        if assignment is None:
            return 1
        try:
            ready = self._load(assignment)
        except RendezvousAborted as exc:
            logger.warning("left the torch.distributed rendezvous: %s", exc)
            return 0
        self._send(ready)
        self.beats.ready()
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
            runner if runner.overlap else None,
            self.drops,
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
                if message.refused:
                    logger.error("the scheduler refused this worker: %s", message.reason)
                else:
                    logger.info("the scheduler turned this worker away: %s", message.reason)
                return message
            if message is not None:
                self.drops.drop("%s before the assignment", type(message).__name__)
        logger.error("no assignment from the scheduler at %s", self.address)
        return None

    def _thread_setup(self) -> None:
        """Runs on the step thread before its first plan: the CUDA device and OpenMP's thread count are per thread."""
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _load(self, a: Assignment) -> WorkerReady:
        if self.serves.model and (Path(self.serves.model) / "config.json").is_file():  # the world's: this host's copy
            a = msgspec.structs.replace(a, model=self.serves.model)
        if a.device:
            self.device = torch.device(a.device)  # the scheduler's placement wins
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        where = ParallelRank(ParallelLayout(a.tensor_parallel_size, a.pipeline_parallel_size), a.rank)
        try:
            self.comm = connect(
                where, a.distributed_init, self.options.local_address, self.device, a.distributed_timeout_s, self._gone
            )
        finally:
            if self._rendezvous_monitor is not None:
                self._sock.disable_monitor()
                self._rendezvous_monitor.close(linger=0)
                self._rendezvous_monitor = None
        self.runner, ready = load_rank(a, self.options, self.device, self.comm)
        serve = self.options.kv_role != "decode"
        handoff = make_handoff(
            self.runner.kv_cache, where, serve, self.options.kv_transfer_host, 0, self.options.zmq_curve_dir,
            total_kv_heads=self.runner.model.config.num_kv_heads, same_host=self.options.kv_transfer_mode == "auto",
        )  # fmt: skip
        self.runner.handoff = handoff
        return msgspec.structs.replace(ready, kv_address=handoff.address)

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
        return decode_or_none(self._sock.recv(), self.drops)

    def close(self) -> None:
        if self.runner is not None and self.runner.handoff is not None:
            self.runner.handoff.close()  # its exporter thread and socket
        if self.comm is not None:
            self.comm.close()
        self._sock.close(linger=0)
        self._ctx.term()


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "vllm-worker",
        "Run one model shard: connects to vllm-scheduler, receives step plans over ZMQ, runs the model on its "
        "device and returns sampled tokens.",
    )


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        options = from_args(WorkerOptions, args)
    except ValueError as exc:
        logger.error("%s", exc)
        return EXIT_BAD_FLAGS
    if threading.current_thread() is threading.main_thread():  # not in a Ray actor's thread: Ray handles signals
        signal.signal(signal.SIGTERM, _exit_cleanly)
    problem = offload_dir_problem(options.kv_offload_disk) if options.kv_offload_disk else ""
    if problem:  # before joining: a world that waits for this rank would wait for nothing
        logger.error("%s", problem)
        return EXIT_BAD_FLAGS
    beats = Beats()  # to the launcher that started this process, if any (proto/liveness.py)
    try:
        worker = Worker(options, beats, Serves.from_args(args))
    except (CurveError, JoinAddressError) as exc:
        logger.error("%s", exc)
        return EXIT_BAD_FLAGS
    except TimeoutError as exc:
        logger.error("%s", exc)
        return 1
    try:
        return worker.run()
    except (KeyboardInterrupt, SystemExit):
        logger.info("stopped by signal")
        return 0
    finally:
        beats.stop()  # leaving: a close that hangs is ended by the launcher
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
