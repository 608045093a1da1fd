"""vllm-scheduler: the central process. Serves gRPC, waits for its workers, then runs the engine loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from proto.curve import ensure_keys
from proto.parallel import ParallelLayout
from scheduler_node.api.grpc_server import GenerationService, build_server
from scheduler_node.api.health import report_health, set_serving
from scheduler_node.api.openai_server import OpenAIConfig, OpenAIDoor, OpenAIServer, build_app
from scheduler_node.api.reasoning_parsers import reasoning_parser_class
from scheduler_node.api.security import server_credentials
from scheduler_node.api.tool_parsers import tool_parser_class
from scheduler_node.cli.signals import stop_signals
from scheduler_node.core.kv.prefix_events import KVEventSink
from scheduler_node.engine.builder import WorldPlan, check_model_split, make_engine
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


async def serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    placement = resolve_parallel(args)
    layout = placement.layout
    folder = resolve_model(args.model)
    check_model_split(
        folder, layout, config.quantization, config.scheduler.speculative, config.multimodal.extra_modules
    )
    tokenizer = ModelTokenizer(folder)
    if args.zmq_curve_dir:
        ensure_keys(args.zmq_curve_dir)
    link = WorkerLink(f"{args.worker_host}:{args.worker_port}", args.heartbeat_timeout, args.zmq_curve_dir)
    service = GenerationService(tokenizer, args.served_model_name or served_name(args.model))
    service.link = link
    credentials = server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None
    server, health = build_server(service, f"{args.host}:{args.port}", credentials, args.control_token)
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
    logger.info(
        "gRPC on %s:%d; waiting for %d worker(s) on %s:%d",
        args.host,
        args.port,
        layout.world_size,
        args.worker_host,
        args.worker_port,
    )
    if layout.world_size > 1:
        logger.info("%s", placement.describe())
    world = WorldPlan(config, folder, placement, args.distributed_port)
    link.claim = world.claim
    link.output_rank = layout.output_rank

    stop, hurry = stop_signals()  # the first signal drains, a second ends the drain
    if args.exit_after_drain:
        service.on_drained = lambda: _stop_after_drain(stop)
    gather = asyncio.ensure_future(link.start(world.assignment, config.worker_join_timeout))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({gather, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not gather.done():
        gather.cancel()
        await _shutdown(server, link, "scheduler stopped before the workers joined", http)
        return 0
    try:
        capacity = gather.result()
    except TimeoutError:
        await _shutdown(server, link, "the world did not assemble in time", http)  # the joined workers leave too
        raise
    engine = make_engine(config, folder, tokenizer, link, capacity, metrics)
    metrics.bind(engine.live_metrics, asyncio.get_running_loop())
    kv_events = publish_kv_events(engine, args) if args.kv_events_port else None
    service.engine = engine
    if door is not None:
        door.engine = engine
    engine_task = asyncio.ensure_future(engine.run())
    health_task = asyncio.ensure_future(report_health(engine, health))
    logger.info(
        "serving %s on %s:%d: %d KV blocks of %d tokens, max_model_len %d",
        folder.name,
        args.host,
        args.port,
        capacity.num_kv_blocks,
        config.scheduler.block_size,
        engine.max_model_len,
    )
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
    await set_serving(health, False)
    engine_task.cancel()
    await _shutdown(server, link, "scheduler shutting down", http)
    metrics.close()
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
