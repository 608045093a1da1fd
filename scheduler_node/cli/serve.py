"""vllm-serve: one scheduler plus its TP x PP workers (child processes, or Ray actors with --launcher ray), stopped
together on Ctrl-C/SIGTERM."""

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
from scheduler_node.cli.openai_flags import API_KEY_ENV, SERVE_OPENAI_PORT
from scheduler_node.cli.operations import TOKEN_ENV
from scheduler_node.cli.scheduler import add_scheduler_flags, resolve_parallel
from scheduler_node.engine.launchers import add_launcher_flags, make_launcher
from scheduler_node.engine.processes import terminate

logger = logging.getLogger("vllm-serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-serve",
        description="Start vllm-scheduler and --tensor-parallel-size x --pipeline-parallel-size vllm-worker "
        "processes, on this host or as Ray actors (scheduler and worker flags below); Ctrl-C or SIGTERM stops "
        "them all.",
    )
    add_config_flag(p)
    add_scheduler_flags(p)
    p.set_defaults(openai_port=SERVE_OPENAI_PORT)
    add_worker_flags(p)
    add_launcher_flags(p)
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
    try:
        launcher = make_launcher(args, placement.layout)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    env = dict(os.environ)
    argv = scheduler_argv(args) + launcher.scheduler_flags()
    for flag, var in (("--control-token", TOKEN_ENV), ("--api-key", API_KEY_ENV)):
        i = argv.index(flag)  # secrets go in the environment: a command line is visible to all local users
        env[var] = argv[i + 1]
        del argv[i : i + 2]
    if args.zmq_curve_dir:
        ensure_keys(args.zmq_curve_dir)  # before the workers look for them
    # Children get their own session, so a terminal's Ctrl-C reaches only vllm-serve, which drains in order.
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "scheduler_node.cli.scheduler", *argv], env=env, start_new_session=True
    )
    worker_flags = ["--log-level", args.log_level, *worker_argv(args)]
    worker_flags += ["--zmq-curve-dir", args.zmq_curve_dir] if args.zmq_curve_dir else []
    launcher.start(f"{args.worker_host}:{args.worker_port}", worker_flags)
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
        launcher.keep_alive()
        time.sleep(0.2)
    terminate([scheduler], args.drain_timeout + 15.0)  # it drains, then tells its workers to shut down
    launcher.stop(10.0)
    return 0 if signals else code


if __name__ == "__main__":
    sys.exit(main())
