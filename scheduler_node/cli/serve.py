"""vllm-serve: one scheduler plus its TP x PP local workers as child processes, stopped together on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from proto.cli_config import add_config_flag, parse_args
from proto.curve import ensure_keys
from proto.worker_flags import add_worker_flags, worker_argv
from scheduler_node.cli.operations import TOKEN_ENV
from scheduler_node.cli.scheduler import add_scheduler_flags, resolve_parallel

logger = logging.getLogger("vllm-serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-serve",
        description="Start vllm-scheduler and --tensor-parallel-size x --pipeline-parallel-size vllm-worker "
        "processes on this host (scheduler and worker flags below); Ctrl-C or SIGTERM stops them all.",
    )
    add_config_flag(p)
    add_scheduler_flags(p)
    add_worker_flags(p)
    return p


def scheduler_argv(args: argparse.Namespace) -> list[str]:
    """The scheduler's flags in `args`, in command-line form (every flag the scheduler knows)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_scheduler_flags(parser)
    argv = []
    for action in parser._actions:
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


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
    try:
        placement = resolve_parallel(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.print_placement:
        print(placement.describe())
        return 0
    env = dict(os.environ)
    argv = scheduler_argv(args)
    i = argv.index("--control-token")  # passed in the environment: a command line is visible to all local users
    env[TOKEN_ENV] = argv[i + 1]
    del argv[i : i + 2]
    if args.zmq_curve_dir:
        ensure_keys(args.zmq_curve_dir)  # before the workers look for them
    # Children get their own session, so a terminal's Ctrl-C reaches only vllm-serve, which drains in order.
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "scheduler_node.cli.scheduler", *argv], env=env, start_new_session=True
    )
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
        *(["--zmq-curve-dir", args.zmq_curve_dir] if args.zmq_curve_dir else []),
    ]
    workers = [_Child(worker_cmd) for _ in range(placement.layout.world_size)]
    signals = 0

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal signals
        signals += 1
        if signals > 1 and scheduler.poll() is None:
            scheduler.send_signal(signal.SIGTERM)  # a second signal: the scheduler ends its drain at once

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    while not signals:
        if scheduler.poll() is not None:
            code = scheduler.returncode or 1
            logger.error("the scheduler (pid %d) exited with %s; stopping the workers", scheduler.pid, code)
            break
        for child in workers:
            child.keep_alive()
        time.sleep(0.2)
    _stop([scheduler], args.drain_timeout + 15.0)  # it drains, then tells its workers to shut down
    _let_exit([w.proc for w in workers], 10.0)  # they got Shutdown: a SIGTERM during their exit only adds noise
    _stop([w.proc for w in workers])
    return 0 if signals else code


def _let_exit(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


class _Child:
    """A worker process that is started again when it exits (a lost worker rejoins its rank), with a growing
    pause when it keeps exiting right after its start."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc = self._start()
        self.failures = 0
        self.restart_at = 0.0

    def _start(self) -> subprocess.Popen:
        self.started = time.monotonic()
        return subprocess.Popen(self.argv, start_new_session=True)

    def keep_alive(self) -> None:
        if self.proc.poll() is None:
            return
        now = time.monotonic()
        if not self.restart_at:
            self.failures = self.failures + 1 if now - self.started < 30 else 0
            self.restart_at = now + (min(30.0, 2.0 ** (self.failures - 1)) if self.failures > 1 else 0.0)
            logger.warning(
                "worker pid %d exited with %s; a replacement starts in %.0f s",
                self.proc.pid,
                self.proc.returncode,
                self.restart_at - now,
            )
        if now >= self.restart_at:
            self.restart_at = 0.0
            self.proc = self._start()


if __name__ == "__main__":
    sys.exit(main())
