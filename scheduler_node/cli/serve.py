"""vllm-serve: one scheduler plus its TP x PP workers (child processes, or Ray actors with --launcher ray), or with
--data-parallel-size N, N such replicas behind a vllm-router; all stopped together on Ctrl-C/SIGTERM. A scheduler
that exits 0 (drained: --exit-after-drain, or stopped by a signal of its own) is started again, with the same
flags; SIGHUP restarts the replicas one at a time, migrating their streams (scheduler_node/cli/rolling.py). This module
builds the children's flags and starts them; scheduler_node/cli/supervisor.py watches over them."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from proto.curve import ensure_keys
from proto.parallel import ParallelLayout
from scheduler_node.cli.scheduler import resolve_parallel
from scheduler_node.cli.supervisor import Supervisor, spawn
from scheduler_node.engine.data_parallel import ReplicaPlan, plan_replicas
from scheduler_node.engine.launchers import make_launcher
from scheduler_node.engine.model_path import resolve_model, served_name
from scheduler_node.engine.ports import free_port
from scheduler_node.engine.topology import load_topology
from settings.cli import to_argv
from settings.commands import COMMANDS, command_parser
from settings.config_file import parse_args
from settings.process import API_KEY_ENV, TOKEN_ENV
from settings.worker import offload_dir_problem, worker_argv

logger = logging.getLogger("vllm-serve")


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "vllm-serve",
        "Start vllm-scheduler and --tensor-parallel-size x --pipeline-parallel-size vllm-worker processes, on this "
        "host or as Ray actors (scheduler and worker flags below); Ctrl-C or SIGTERM stops them all. A scheduler "
        "that exits 0 (drained, with --exit-after-drain) is started again. SIGHUP, with --data-parallel-size >= 2: a "
        "rolling restart, each replica in turn drained with migrate (its streams go on on the others), restarted "
        "and back in the routing before the next (with one replica: ignored).",
    )


def scheduler_argv(args: argparse.Namespace) -> list[str]:
    """The scheduler's flags in `args`, in command-line form (every flag the scheduler knows)."""
    return to_argv(COMMANDS["vllm-scheduler"].parts, vars(args))


def replica_plans(args: argparse.Namespace) -> list[ReplicaPlan]:
    """One plan per replica: the world of a single replica at --port (no router), or N on loopback behind one.

    Without --worker-port (0) each replica's workers join at a free port: they are this process's children, so no
    one else needs to know it, and a fixed one made a second vllm-serve on the host fail to bind it while its
    workers joined the first one's scheduler."""
    if args.memory_sharing and args.data_parallel_size == 1:
        raise ValueError(
            "memory_sharing (--memory-sharing) pulls a prefix's KV blocks from a peer replica: it needs "
            "--data-parallel-size >= 2, got 1"
        )
    if args.data_parallel_size == 1:
        placement = resolve_parallel(args)
        return [ReplicaPlan(0, placement, args.port, args.worker_port or free_port())]
    if args.launcher == "ray":
        raise ValueError("--data-parallel-size > 1 runs its replicas with --launcher local (ray: one world only)")
    layout = ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size)
    topology = load_topology(args.topology) if args.topology else None
    gpus = args.device != "cpu"
    spread = args.cross_device == "round_robin"
    plans = plan_replicas(
        args.data_parallel_size, layout, args.worker_port, topology, args.allow_cross_island, gpus, spread
    )
    for plan in plans:
        plan.http_port = free_port() if args.openai_port else 0
        if args.routing_strategy == "kv" or args.memory_sharing:  # each replica publishes its KV events to the router
            plan.kv_events_port, plan.kv_snapshot_port = free_port(), free_port()
    return plans


def replica_argv(args: argparse.Namespace, plan: ReplicaPlan, count: int) -> list[str]:
    """The scheduler flags of one replica: with data parallelism, on loopback behind the router (which does TLS)."""
    mine = argparse.Namespace(**vars(args))
    mine.worker_port = plan.worker_port  # where its workers are told to join (without --worker-port: a free port)
    if count == 1:
        return scheduler_argv(mine)
    mine.host, mine.port = "127.0.0.1", plan.port
    mine.openai_port = plan.http_port
    mine.kv_events_host = "127.0.0.1"
    mine.kv_events_port, mine.kv_events_snapshot_port = plan.kv_events_port, plan.kv_snapshot_port
    mine.topology = str(plan.topology_file) if plan.topology_file else None
    mine.tls_cert = mine.tls_key = None
    mine.metrics_port = args.metrics_port + 1 + plan.index if args.metrics_port else 0
    mine.served_model_name = args.served_model_name or served_name(args.model)
    mine.exit_after_drain = True  # drained (vllm-client drain --migrate, a rolling restart): vllm-serve restarts it
    return scheduler_argv(mine)


def router_argv(args: argparse.Namespace, plans: list[ReplicaPlan]) -> list[str]:
    name = args.served_model_name or served_name(args.model)
    argv = ["--host", args.host, "--port", str(args.port), "--log-level", args.log_level]
    argv += ["--routing-strategy", args.routing_strategy, "--routing-prefix-chars", str(args.routing_prefix_chars)]
    argv += ["--routing-load-factor", str(args.routing_load_factor), "--shutdown-timeout", str(args.shutdown_timeout)]
    argv += ["--kv-overlap-weight", str(args.kv_overlap_weight)]
    argv += ["--memory-sharing"] if args.memory_sharing else []
    argv += ["--metrics-port", str(args.metrics_port), "--metrics-host", args.metrics_host]
    argv += ["--openai-port", str(args.openai_port)]  # its --api-key and the replicas' come in the environment
    argv += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key] if args.tls_cert else []
    for plan in plans:
        http = f",http=127.0.0.1:{plan.http_port}" if plan.http_port else ""
        if plan.kv_events_port:
            http += f",kv_events=127.0.0.1:{plan.kv_events_port},kv_snapshot=127.0.0.1:{plan.kv_snapshot_port}"
            http += f",tokenizer={resolve_model(args.model)}"
        argv += ["--replica", f"{plan.address},model={name}{http}"]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        plans = replica_plans(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.print_placement:
        print("\n\n".join(f"replica {p.index} at {p.address}:\n{p.placement.describe()}" if len(plans) > 1
                          else p.placement.describe() for p in plans))  # fmt: skip
        return 0
    problem = offload_dir_problem(args.kv_offload_disk) if args.kv_offload_disk and args.launcher == "local" else ""
    if problem:  # the workers would refuse it, and be restarted to refuse it again
        logger.error("%s", problem)
        return 2
    try:
        launchers = [make_launcher(args, p.placement.layout, p.worker_env) for p in plans]
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    env = dict(os.environ)
    env[TOKEN_ENV] = args.control_token  # secrets go in the environment: a command line is visible to all local users
    env[API_KEY_ENV] = args.api_key
    if args.zmq_curve_dir:
        ensure_keys(args.zmq_curve_dir)  # before the workers look for them
    flags = [
        _without_secrets(replica_argv(args, p, len(plans))) + r.scheduler_flags() for p, r in zip(plans, launchers)
    ]
    schedulers = [spawn("scheduler_node.cli.scheduler", f, env) for f in flags]
    worker_flags = ["--log-level", args.log_level, *worker_argv(args)]
    for plan, launcher in zip(plans, launchers):
        launcher.start(f"{args.worker_host}:{plan.worker_port}", worker_flags)
    routers = [spawn("router_node.main", router_argv(args, plans), env)] if len(plans) > 1 else []
    return Supervisor(args, plans, launchers, schedulers, flags, routers, env).run()


def _without_secrets(argv: list[str]) -> list[str]:
    """The flags without the control token and the API key (the children read them from the environment)."""
    for flag in ("--control-token", "--api-key"):
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2 :]
    return argv


if __name__ == "__main__":
    sys.exit(main())
