"""vllm-scheduler: the central process. Serves gRPC, waits for its workers, then runs the engine loop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

from proto.cli_config import add_config_flag, parse_args
from proto.wire import Assignment
from scheduler_node.config import SchedulerConfig
from scheduler_node.engine import Engine
from scheduler_node.model_path import DEFAULT, resolve_model
from scheduler_node.policy import POLICIES, make_policy
from scheduler_node.scheduler import Scheduler
from scheduler_node.server import GenerationService, build_server, set_serving
from scheduler_node.tokenizer import ModelTokenizer
from scheduler_node.worker_link import WorkerLink

logger = logging.getLogger("vllm-scheduler")


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT, help="HF safetensors folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument("--worker-host", default="127.0.0.1", help="bind address of the ZMQ socket workers join")
    p.add_argument("--worker-port", type=int, default=50061, help="port of the ZMQ socket workers join")
    p.add_argument("--num-workers", type=int, default=1, help="workers to wait for before serving")
    p.add_argument("--worker-join-timeout", type=float, default=600.0, help="seconds to wait for all workers")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype on the workers (auto: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (8, 16, 32, 64, 128)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step; prompts longer than this are prefilled in chunks",
    )
    p.add_argument("--max-num-seqs", type=int, default=128, help="running requests at most")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="context length (0: the model's, capped by the KV cache capacity)",
    )
    p.add_argument("--scheduling-policy", default="fcfs", choices=sorted(POLICIES), help="request order")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-scheduler",
        description="The central scheduler: gRPC Generate/Abort for clients, step plans over ZMQ to "
        "vllm-worker processes that join at --worker-host:--worker-port.",
    )
    add_config_flag(p)
    add_scheduler_flags(p)
    return p


def resolve_max_model_len(requested: int, model_limit: int, num_blocks: int, block_size: int) -> int:
    capacity = num_blocks * block_size
    if requested > capacity:
        raise ValueError(
            f"--max-model-len {requested} needs more KV than the workers have ({capacity} tokens); "
            "give the workers more --kv-cache-memory or lower --max-model-len"
        )
    if requested:
        return min(requested, model_limit)
    if capacity < model_limit:
        logger.warning("max_model_len capped at the KV capacity: %d tokens (model allows %d)", capacity, model_limit)
    return min(model_limit, capacity)


def model_limit(folder: Path) -> int:
    c = json.loads((folder / "config.json").read_text())
    limit = int(c.get("max_position_embeddings", 4096))
    if c.get("use_sliding_window", c.get("model_type") == "mistral") and c.get("sliding_window"):
        limit = min(limit, int(c["sliding_window"]))  # the workers do not implement sliding windows
    return limit


async def serve(args: argparse.Namespace) -> int:
    config = SchedulerConfig(args.block_size, args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len)
    policy = make_policy(args.scheduling_policy)
    folder = resolve_model(args.model)
    tokenizer = ModelTokenizer(folder)
    link = WorkerLink(f"{args.worker_host}:{args.worker_port}")
    service = GenerationService(tokenizer)
    server, health = build_server(service, f"{args.host}:{args.port}")
    await server.start()
    await set_serving(health, False)
    logger.info(
        "gRPC on %s:%d; waiting for %d worker(s) on %s:%d",
        args.host,
        args.port,
        args.num_workers,
        args.worker_host,
        args.worker_port,
    )

    def assignment(rank: int) -> Assignment:
        return Assignment(
            rank,
            args.num_workers,
            str(folder),
            args.dtype,
            config.block_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gather = asyncio.ensure_future(link.gather(args.num_workers, assignment, args.worker_join_timeout))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({gather, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not gather.done():
        gather.cancel()
        await _shutdown(server, link, "scheduler stopped before the workers joined")
        return 0
    workers = gather.result()
    num_blocks = min(w.num_kv_blocks for w in workers)
    max_len = resolve_max_model_len(config.max_model_len, model_limit(folder), num_blocks, config.block_size)
    scheduler = Scheduler(dataclasses.replace(config, max_model_len=max_len), num_blocks, policy)
    engine = Engine(scheduler, tokenizer, link)
    service.engine = engine
    engine_task = asyncio.ensure_future(engine.run())
    await set_serving(health, True)
    logger.info(
        "serving %s on %s:%d: %d KV blocks of %d tokens, max_model_len %d",
        folder.name,
        args.host,
        args.port,
        num_blocks,
        config.block_size,
        max_len,
    )
    await asyncio.wait({engine_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if engine_task.done():
        code = 1
        logger.error("engine stopped: %s", engine.failed or engine_task.exception())
    logger.info("shutting down")
    await set_serving(health, False)
    engine_task.cancel()
    await _shutdown(server, link, "scheduler shutting down")
    return code


async def _shutdown(server, link: WorkerLink, reason: str) -> None:  # type: ignore[no-untyped-def]
    await server.stop(grace=2.0)
    await link.close(reason)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return asyncio.run(serve(args))
    except (ValueError, FileNotFoundError, TimeoutError, OSError) as exc:
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
