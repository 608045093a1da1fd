"""vllm-scheduler: the central process. Serves gRPC, waits for its workers, then runs the engine loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from proto.curve import ensure_keys
from proto.parallel import ParallelLayout
from proto.transport import WorldCapacity
from scheduler_node.api.grpc_server import GenerationService, build_server
from scheduler_node.api.health import report_health, set_serving
from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, OpenAIServer, build_app
from scheduler_node.api.reasoning_parsers import reasoning_parser_class
from scheduler_node.api.security import server_credentials
from scheduler_node.api.tool_parsers import tool_parser_class
from scheduler_node.cli.adopt import adopt_first_worker, world_vet
from scheduler_node.cli.join_door import join_handler
from scheduler_node.cli.signals import stop_signals
from scheduler_node.core.kv.prefix_events import KVEventSink
from scheduler_node.engine.builder import WorldPlan, check_model_split, make_engine, with_block_bytes
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.kv_publisher import KVEventPublisher
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.model_path import resolve_model, served_name
from scheduler_node.engine.outputs import ErrorStatus
from scheduler_node.engine.placement import Placement, place
from scheduler_node.engine.topology import load_topology, single_island
from scheduler_node.engine.worker_link import WorkerLink
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.build import names
from settings.cli import from_args
from settings.commands import command_parser
from settings.config_file import parse_args
from settings.engine import EngineConfig
from settings.engine_args import engine_settings
from settings.server import OpenAIApi

logger = logging.getLogger("vllm-scheduler")


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "vllm-scheduler",
        "The central scheduler: gRPC Generate/Abort (and with --openai-port the OpenAI HTTP API) for clients, step "
        "plans over ZMQ to vllm-worker processes that join at --worker-host:--worker-port.",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from the command line, as `LLM(...)` builds them from its keywords (ValueError naming
    what is out of range)."""
    values = vars(args)
    return engine_settings({name: values[name] for name in names(EngineConfig) if name in values}).engine


def resolve_parallel(args: argparse.Namespace) -> Placement:
    """The layout and where each rank goes; ValueError (naming what does not fit) when it cannot work."""
    layout = ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size)
    if args.num_workers is not None and args.num_workers != layout.world_size:
        raise ValueError(
            f"--num-workers {args.num_workers} != --tensor-parallel-size {layout.tensor_parallel_size} x "
            f"--pipeline-parallel-size {layout.pipeline_parallel_size}; drop --num-workers (it is derived)"
        )
    if args.topology:
        return place(load_topology(args.topology), layout, args.allow_cross_island)
    return place(single_island(layout.world_size), layout, worker_chooses_device=True)


def plan_world(args: argparse.Namespace) -> tuple[EngineConfig, Placement, Path]:
    """The engine's settings (a block size given in bytes made tokens for this model), where each rank goes, and
    the model's folder; ValueError or FileNotFoundError naming what does not fit."""
    config = engine_config(args)
    placement = resolve_parallel(args)
    folder = resolve_model(args.model)
    s = config.scheduler
    check_model_split(folder, placement.layout, config.quantization, s.speculative, config.multimodal.extra_modules)
    return with_block_bytes(config, folder), placement, folder


def openai_config(args: argparse.Namespace, served_model_name: str) -> OpenAIConfig | None:
    """The door's settings, or None when --openai-port is 0; ValueError naming a parser that does not load."""
    door = from_args(OpenAIApi, args)
    if not door.openai_port:
        return None
    tool_parser_class(door.tool_call_parser)  # ValueErrors naming them
    reasoning_parser_class(door.reasoning_parser)
    return OpenAIConfig(
        args.host,
        door.openai_port,
        served_model_name,
        api_key=args.api_key,
        control_token=args.control_token,
        tool_call_parser=door.tool_call_parser,
        reasoning_parser=door.reasoning_parser,
        embedding_pooling=door.embedding_pooling,
    )


@dataclass
class Doors:
    """What the scheduler serves before its world exists: the gRPC door (health NOT_SERVING until the engine runs,
    the workers' join call), the OpenAI door when configured, the metrics."""

    service: GenerationService
    server: grpc.aio.Server
    health: Any
    metrics: Metrics
    door: OpenAIDoor | None
    http: OpenAIServer | None

    def attach(self, engine: EngineCore) -> None:
        self.service.engine = engine
        if self.door is not None:
            self.door.engine = engine
        self.metrics.bind(engine.live_metrics, asyncio.get_running_loop())

    async def close(self, link: WorkerLink, why: str) -> None:
        await _shutdown(self.server, link, why, self.http)


async def serve(args: argparse.Namespace) -> int:
    if not args.worker_host:  # vllm-scheduler's default: where gRPC listens (remote workers reach both there)
        args.worker_host = args.host if ":" not in args.host else "127.0.0.1"  # the ZMQ socket binds IPv4 only
    if args.zmq_curve_dir:
        ensure_keys(args.zmq_curve_dir)
    link = WorkerLink(f"{args.worker_host}:{args.worker_port}", args.heartbeat_timeout, args.zmq_curve_dir)
    args, (config, placement, folder), tokenizer = await _the_world(args, link)
    link.registry.vet = world_vet(args.model, placement.layout)
    doors = await _open_doors(args, link, tokenizer)
    world = WorldPlan(config, folder, placement, args.distributed_port)
    link.claim = world.claim
    link.output_rank = placement.layout.output_rank
    stop, hurry = stop_signals()  # the first signal drains, a second ends the drain
    if args.exit_after_drain:
        doors.service.on_drained = lambda: _stop_after_drain(stop)
    capacity = await _gather(link, world, placement, stop, doors)
    if capacity is None:
        return 0
    engine = make_engine(config, folder, tokenizer, link, capacity, doors.metrics)
    doors.attach(engine)
    logger.info(
        "serving %s on %s:%d: %d KV blocks of %d tokens, max_model_len %d",
        folder.name,
        args.host,
        args.port,
        capacity.num_kv_blocks,
        config.scheduler.block_size,
        engine.max_model_len,
    )
    code = await _run_until_stopped(engine, args, doors, stop, hurry)
    await doors.close(link, "scheduler shutting down")
    doors.metrics.close()
    return code


async def _the_world(
    args: argparse.Namespace, link: WorkerLink
) -> tuple[argparse.Namespace, tuple[EngineConfig, Placement, Path], ModelTokenizer]:
    """The model and the world's shape: from the flags, or from the first worker that joins (without --model,
    scheduler_node/cli/adopt.py); a world the scheduler cannot serve refuses the workers waiting to join."""
    if not args.model:
        args = await adopt_first_worker(args, link)
    try:
        planned = plan_world(args)
        return args, planned, ModelTokenizer(planned[2])
    except (ValueError, OSError) as exc:
        link.registry.refuse_parked(f"the scheduler cannot serve this world: {exc}")
        await link.close(str(exc))
        raise


async def _open_doors(args: argparse.Namespace, link: WorkerLink, tokenizer: ModelTokenizer) -> Doors:
    """The gRPC door (NOT_SERVING until the engine runs; it answers the workers' join call), the OpenAI door when
    configured, and the metrics endpoint."""
    service = GenerationService(tokenizer, args.served_model_name or served_name(args.model))
    service.link = link
    credentials = server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None
    server, health = build_server(service, f"{args.host}:{args.port}", credentials, args.control_token)
    server.add_generic_rpc_handlers((join_handler(f"{args.worker_host}:{args.worker_port}"),))
    metrics = Metrics(service.served_model_name)
    metrics.count_drops(link.drops)
    http_config = openai_config(args, service.served_model_name)
    door = OpenAIDoor(http_config, tokenizer, metrics) if http_config else None
    http = OpenAIServer(build_app(door), door.config.host, door.config.port) if door else None  # binds now
    if args.metrics_port:
        metrics.serve(args.metrics_host, args.metrics_port)
    await server.start()
    if http is not None:
        http.start()
    await set_serving(health, False)
    return Doors(service, server, health, metrics, door, http)


async def _gather(
    link: WorkerLink, world: WorldPlan, placement: Placement, stop: asyncio.Event, doors: Doors
) -> WorldCapacity | None:
    """The world's capacity once every rank has joined; None when a signal came first (the doors are closed)."""
    logger.info("waiting for %d worker(s) on %s", placement.layout.world_size, link.address)
    if placement.layout.world_size > 1:
        logger.info("%s", placement.describe())
    gather = asyncio.ensure_future(link.start(world.assignment, world.config.worker_join_timeout))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({gather, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not gather.done():
        gather.cancel()
        await doors.close(link, "scheduler stopped before the workers joined")
        return None
    try:
        return gather.result()
    except TimeoutError:
        await doors.close(link, "the world did not assemble in time")  # the joined workers leave too
        raise


async def _run_until_stopped(
    engine: EngineCore, args: argparse.Namespace, doors: Doors, stop: asyncio.Event, hurry: asyncio.Event
) -> int:
    """Serve until a signal (drain, then end what is left) or the engine's own end; the exit code."""
    kv_events = publish_kv_events(engine, args) if args.kv_events_port else None
    engine_task = asyncio.ensure_future(engine.run())
    health_task = asyncio.ensure_future(report_health(engine, doors.health))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({engine_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if engine_task.done():
        code = 1
        logger.error("engine stopped: %s", engine.failed or engine_task.exception())
    else:
        remaining = await engine.drain(args.shutdown_timeout or None, hurry)
        if remaining:
            why = "a second signal" if hurry.is_set() else f"--shutdown-timeout ({args.shutdown_timeout:g} s) passed"
            logger.warning("%d request(s) still live at shutdown (%s); ending them with UNAVAILABLE", remaining, why)
            engine.end_all(f"the server is shutting down: {why} before the request finished", ErrorStatus.UNAVAILABLE)
    logger.info("shutting down")
    health_task.cancel()
    if kv_events is not None:
        kv_events.cancel()
    await set_serving(doors.health, False)
    engine_task.cancel()
    return code


def _stop_after_drain(stop: asyncio.Event) -> None:
    logger.info("Control.Drain drained this scheduler: exiting (--exit-after-drain)")
    stop.set()


def publish_kv_events(engine: EngineCore, args: argparse.Namespace) -> asyncio.Future:
    """The engine's prefix-cache changes on --kv-events-port (the task that answers snapshots and heartbeats)."""
    sink = KVEventSink()
    engine.scheduler.attach_kv_events(sink)
    blocks = engine.scheduler.blocks
    publisher = KVEventPublisher(sink, blocks.block_size, args.kv_events_host, args.kv_events_port,
                                 args.kv_events_snapshot_port)  # fmt: skip
    engine.after_step = publisher.publish
    engine.metrics.count_drops(publisher.drops)
    logger.info("KV events on %s (snapshots on %s)", publisher.address, publisher.snapshot_address)
    return asyncio.ensure_future(publisher.run())


async def _shutdown(server, link: WorkerLink, reason: str, http: OpenAIServer | None) -> None:  # type: ignore[no-untyped-def]
    if http is not None:
        await http.stop()
    await server.stop(grace=2.0)
    await link.close(reason)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.print_placement:
            print(resolve_parallel(args).describe())
            return 0
        return asyncio.run(serve(args))
    except (ValueError, FileNotFoundError, TimeoutError, OSError) as exc:
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
