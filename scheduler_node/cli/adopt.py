"""A world that learns what it serves from its workers (article 003's multi-node lines): `vllm-scheduler --host H
--port 50051` without --model takes the model and the world's shape (TP, PP) from the first worker that names them
(`vllm-worker --model M --scheduler-address H:50051 --tensor-parallel-size 2 --pipeline-parallel-size 2`); and,
with or without --model, a worker that names another model or shape than the world's is refused, by name."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from proto.parallel import ParallelLayout
from proto.wire import WorkerHello
from scheduler_node.cli.join_door import start_join_door
from scheduler_node.engine.model_path import DEFAULT, resolve_model
from scheduler_node.engine.worker_link import WorkerLink

logger = logging.getLogger("vllm-scheduler")


async def adopt_first_worker(args: argparse.Namespace, link: WorkerLink) -> argparse.Namespace:
    """`args` with the model and TP/PP of the first worker to say Hello (the scheduler's own when it names none:
    the default model). Meanwhile the gRPC port answers only where workers join (scheduler_node/cli/join_door.py;
    not behind --tls-cert: workers are then given the worker socket itself). TimeoutError after
    --worker-join-timeout without one."""
    endpoint = f"{args.worker_host}:{args.worker_port}"
    door = None if args.tls_cert else await start_join_door(f"{args.host}:{args.port}", endpoint)
    logger.info("no --model: waiting for the first worker to name it (workers join on %s)", endpoint)
    try:
        hello = await asyncio.wait_for(link.first_hello(), args.worker_join_timeout)
    except asyncio.TimeoutError:
        await link.close("no world to serve")
        why = f"no worker joined {endpoint} within {args.worker_join_timeout:g} s (--worker-join-timeout)"
        raise TimeoutError(why) from None
    finally:
        if door is not None:
            await door.stop(None)
    return adopted(args, hello)


def adopted(args: argparse.Namespace, hello: WorkerHello) -> argparse.Namespace:
    """`args` with what `hello` says the world serves."""
    mine = argparse.Namespace(**vars(args))
    if not hello.model:
        mine.model = DEFAULT
        logger.info("the first worker (pid %d on %s) names no model: serving %s", hello.pid, hello.host, DEFAULT)
        return mine
    mine.model = hello.model
    mine.tensor_parallel_size = hello.tensor_parallel_size or 1
    mine.pipeline_parallel_size = hello.pipeline_parallel_size or 1
    mine.num_workers = None  # derived from the worker's TP x PP
    logger.info(
        "serving %s with TP %d x PP %d, as the first worker (pid %d on %s) says",
        hello.model,
        mine.tensor_parallel_size,
        mine.pipeline_parallel_size,
        hello.pid,
        hello.host,
    )
    return mine


def world_vet(model: str, layout: ParallelLayout) -> Callable[[WorkerHello], str]:
    """Why a worker cannot join a world of `model` and `layout` ("" when it can, or when it names no model)."""

    def vet(hello: WorkerHello) -> str:
        if not hello.model:
            return ""
        problems = []
        if not same_model(hello.model, model):
            problems.append(f"--model {hello.model} (the world serves {model})")
        for flag, mine, world in (
            ("--tensor-parallel-size", hello.tensor_parallel_size or 1, layout.tensor_parallel_size),
            ("--pipeline-parallel-size", hello.pipeline_parallel_size or 1, layout.pipeline_parallel_size),
        ):
            if mine != world:
                problems.append(f"{flag} {mine} (the world's is {world})")
        return "this worker disagrees with the world: " + "; ".join(problems) if problems else ""

    return vet


def same_model(a: str, b: str) -> bool:
    """Whether two --model values name one model: the same text, or the same folder once resolved here."""
    if a == b:
        return True
    try:
        return resolve_model(a) == resolve_model(b)
    except (OSError, ValueError):
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
