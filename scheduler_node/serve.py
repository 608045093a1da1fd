"""vllm-serve: one scheduler plus N local workers as child processes, all stopped together on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time

from proto.cli_config import add_config_flag, parse_args
from proto.worker_flags import add_worker_flags, worker_argv
from scheduler_node.main import add_scheduler_flags

logger = logging.getLogger("vllm-serve")

SCHEDULER_FLAGS = (
    "model",
    "host",
    "port",
    "worker_host",
    "worker_port",
    "num_workers",
    "worker_join_timeout",
    "dtype",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "scheduling_policy",
    "log_level",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-serve",
        description="Start vllm-scheduler and --num-workers vllm-worker processes on this host "
        "(scheduler and worker flags below); Ctrl-C or SIGTERM stops them all.",
    )
    add_config_flag(p)
    add_scheduler_flags(p)
    add_worker_flags(p)
    return p


def _argv(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def _stop(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop in time; killing it", p.pid)
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_workers < 1:
        logger.error("--num-workers must be >= 1")
        return 2
    scheduler = subprocess.Popen([sys.executable, "-m", "scheduler_node.main", *_argv(args, SCHEDULER_FLAGS)])
    address = f"{args.worker_host}:{args.worker_port}"
    worker_cmd = [
        sys.executable,
        "-m",
        "worker_node.worker",
        "--scheduler-address",
        address,
        "--log-level",
        args.log_level,
        *worker_argv(args),
    ]
    workers = [subprocess.Popen(worker_cmd) for _ in range(args.num_workers)]
    procs = [scheduler, *workers]
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    while not stopping:
        exited = [p for p in procs if p.poll() is not None]
        if exited:
            code = exited[0].returncode or 1
            logger.error("pid %d exited with %s; stopping the rest", exited[0].pid, exited[0].returncode)
            break
        time.sleep(0.2)
    _stop([scheduler])  # the scheduler tells its workers to shut down
    _stop(workers)
    return 0 if stopping else code


if __name__ == "__main__":
    sys.exit(main())
