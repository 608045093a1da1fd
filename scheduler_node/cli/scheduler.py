"""vllm-scheduler: the central process. Serves gRPC, waits for its workers, then runs the engine loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from proto.cli_config import add_config_flag, parse_args
from proto.curve import ensure_keys
from proto.quantization import QUANTIZATIONS
from scheduler_node.api.grpc_server import GenerationService, build_server
from scheduler_node.api.health import report_health, set_serving
from scheduler_node.api.openai_server import OpenAIDoor, OpenAIServer, build_app
from scheduler_node.api.security import server_credentials
from scheduler_node.cli.kv_flags import add_kv_flags, compact_kv
from scheduler_node.cli.lora_flags import add_lora_flags, lora_config
from scheduler_node.cli.openai_flags import add_openai_flags, openai_config
from scheduler_node.cli.operations import add_operations_flags, check_operations_flags, stop_signals
from scheduler_node.cli.world_flags import add_world_flags, resolve_parallel
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.core.kv_events import KVEventSink
from scheduler_node.core.policy import POLICIES
from scheduler_node.core.speculative import DISABLE_BY_BATCH_SIZE, SpeculativeConfig, speculative_config_flag
from scheduler_node.engine.builder import EngineConfig, WorldPlan, check_model_split, make_engine
from scheduler_node.engine.core import EngineCore, EngineOptions
from scheduler_node.engine.kv_publisher import KVEventPublisher
from scheduler_node.engine.metrics import Metrics
from scheduler_node.engine.model_path import DEFAULT, resolve_model, served_name
from scheduler_node.engine.outputs import ErrorStatus
from scheduler_node.engine.worker_link import WorkerLink
from scheduler_node.text.tokenizer import ModelTokenizer

logger = logging.getLogger("vllm-scheduler")

# The flags' defaults are the engine's own (each default is written once, where the setting is declared).
DEFAULTS = EngineConfig()
SCHEDULER = DEFAULTS.scheduler


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT,
        help="HF folder (safetensors, or a linked GGUF), a .gguf file, an HF hub id (org/name) already in the local "
        "HF cache, or 'default' (SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address of gRPC and the HTTP API")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument("--worker-host", default="127.0.0.1", help="bind address of the ZMQ socket workers join")
    p.add_argument(
        "--worker-port",
        type=int,
        default=50061,
        help="port of the ZMQ socket workers join (vllm-serve's default is 0: a free port, as its workers are its "
        "own children; with --data-parallel-size, replica i's workers join at this + i)",
    )
    add_world_flags(p)
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=DEFAULTS.num_kv_blocks,
        help="KV blocks every worker holds (0: as many as its --kv-cache-memory / --gpu-memory-utilization "
        "allows; the smallest rank's count becomes the world's, and replacements are told to hold exactly it)",
    )
    p.add_argument(
        "--dtype",
        default=DEFAULTS.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype on the workers (auto: bfloat16 on GPU and on CPUs with AVX-512 BF16 or AMX, float32 on "
        "other CPUs)",
    )
    p.add_argument(
        "--quantization",
        default=DEFAULTS.quantization,
        choices=QUANTIZATIONS,
        help="the weights' format: auto (a quantized checkpoint's own, else none), none (the model dtype), int8 "
        "(per-output-channel int8, quantized on load), fp8 (e4m3, quantized on load or an fp8 checkpoint), awq "
        "(an AutoAWQ 4-bit checkpoint); a flag that contradicts the checkpoint's quantization_config is refused",
    )
    p.add_argument(
        "--block-size", type=int, default=SCHEDULER.block_size, help="tokens per KV block (8, 16, 32, 64, 128)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SCHEDULER.max_num_batched_tokens,
        help="token budget of one step; prompts longer than this are prefilled in chunks",
    )
    p.add_argument("--max-num-seqs", type=int, default=SCHEDULER.max_num_seqs, help="running requests at most")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=SCHEDULER.max_model_len,
        help="context length (0: the model's, capped by the KV cache capacity)",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config_flag,
        default="",
        help='speculative decoding, as vLLM spells it: a JSON object such as \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\' or \'{"method": '
        '"draft_model", "model": PATH, "num_speculative_tokens": 4}\' (also "disable_by_batch_size": no '
        f"speculation while more requests run; default {DISABLE_BY_BATCH_SIZE}). Empty: off",
    )
    add_kv_flags(p)
    add_lora_flags(p)
    p.add_argument(
        "--scheduling-policy",
        default=DEFAULTS.scheduling_policy,
        help=f"request order: {', '.join(sorted(POLICIES))}, or module:Class for your own Policy subclass",
    )
    p.add_argument(
        "--aging-interval",
        type=float,
        default=DEFAULTS.aging_interval,
        help="dynamic/hybrid: seconds of age worth one priority point (bounds starvation, see policy.py)",
    )
    p.add_argument(
        "--preemption-margin",
        type=float,
        default=DEFAULTS.preemption_margin,
        help="priority points a waiting request must beat a running one by to displace it (hysteresis)",
    )
    p.add_argument(
        "--watermark",
        type=float,
        default=SCHEDULER.watermark,
        help="fraction of KV blocks kept free when admitting requests (avoids admit-then-preempt thrash)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.async_scheduling,
        help="build and send plan N+1 while the workers run step N; with P pipeline stages, keep P plans on "
        "disjoint requests in flight (--no-async-scheduling: one at a time)",
    )
    p.add_argument(
        "--scheduler-delay",
        type=float,
        default=DEFAULTS.options.scheduler_delay,
        help="seconds to wait for more arrivals before starting a small batch (0: never wait)",
    )
    add_operations_flags(p)
    add_openai_flags(p)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-scheduler",
        description="The central scheduler: gRPC Generate/Abort (and with --openai-port the OpenAI HTTP API) for "
        "clients, step plans over ZMQ to "
        "vllm-worker processes that join at --worker-host:--worker-port.",
    )
    add_config_flag(p)
    add_scheduler_flags(p)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from the command line (ValueError naming what is out of range)."""
    return EngineConfig(
        dtype=args.dtype,
        quantization=args.quantization,
        scheduler=SchedulerConfig(
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            speculative=SpeculativeConfig.parse(args.speculative_config),
            enable_prefix_caching=args.enable_prefix_caching,
            preemption_mode=args.preemption_mode,
            compaction_interval=args.compaction_interval,
            watermark=args.watermark,
            kv_offload_policy=args.kv_offload_policy,
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras,
        ),
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        async_scheduling=args.async_scheduling,
        scheduling_policy=args.scheduling_policy,
        aging_interval=args.aging_interval,
        preemption_margin=args.preemption_margin,
        options=EngineOptions(
            rejoin_timeout=args.worker_rejoin_timeout,
            max_waiting_requests=args.max_waiting_requests,
            scheduler_delay=args.scheduler_delay,
            step_timeout=args.step_timeout,
            schedule_gc=True,
        ),
        num_kv_blocks=args.num_kv_blocks,
        distributed_timeout=args.distributed_timeout,
        kv_compact=compact_kv(args),
        lora=lora_config(args),
    )


async def serve(args: argparse.Namespace) -> int:
    check_operations_flags(args)
    config = engine_config(args)
    placement = resolve_parallel(args)
    layout = placement.layout
    folder = resolve_model(args.model)
    check_model_split(folder, layout, config.quantization, config.scheduler.speculative)
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
    gather = asyncio.ensure_future(link.start(world.assignment, args.worker_join_timeout))
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
