"""vllm-router: one gRPC address (and with --openai-port one OpenAI API) in front of several schedulers (replicas
of one model, or different models)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable

from router_node.control import RouterControl
from router_node.disaggregate import Disaggregator
from router_node.grpc_door import RouterGeneration
from router_node.http_door import RouterHttp, build_router_app
from router_node.kv_index import KVIndex
from router_node.kv_strategy import KVAware, PromptTokens
from router_node.kv_subscriber import KVSubscriber
from router_node.metrics import RouterMetrics
from router_node.prefix_sharing import PrefixSharing
from router_node.probe import Prober, report_health
from router_node.rebalance import Rebalancer
from router_node.replica import Replica, ReplicaPool
from router_node.routing import Router
from router_node.upstream import Forwarder, open_links
from scheduler_node.api.grpc_server import build_server
from scheduler_node.api.health import set_serving
from scheduler_node.api.openai_server import OpenAIServer
from scheduler_node.api.security import server_credentials
from scheduler_node.cli.signals import stop_signals
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.commands import command_parser
from settings.config_file import parse_args

logger = logging.getLogger("vllm-router")


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "vllm-router",
        "Route minivllm.v1.Generation requests (and with --openai-port OpenAI API requests) over several "
        "vllm-scheduler replicas by the request's model and a strategy, with health checks and one retry before "
        "the first token.",
    )


def kv_routing(pool: ReplicaPool, args: argparse.Namespace, metrics: RouterMetrics) -> tuple[KVAware, KVSubscriber]:
    """The `kv` strategy over an index fed by the replicas' KV events (ValueError when none publishes them)."""
    if not any(r.spec.kv_events for r in pool.replicas):
        why = "--routing-strategy kv" if args.routing_strategy == "kv" else "--memory-sharing"
        raise ValueError(f"{why}: no --replica has kv_events=HOST:PORT (its --kv-events-port)")
    tokenizers: dict[str, ModelTokenizer] = {}
    for r in pool.replicas:
        if not r.spec.kv_events:
            logger.warning("replica %s has no kv_events=HOST:PORT: kv routing sees nothing cached there", r.address)
        if r.spec.tokenizer and r.model not in tokenizers:
            try:
                tokenizers[r.model] = ModelTokenizer(r.spec.tokenizer)
            except FileNotFoundError as exc:
                raise ValueError(f"replica {r.address}: tokenizer: {exc}") from None
    index = KVIndex()
    subscriber = KVSubscriber(pool, index, metrics)
    strategy = KVAware(index, subscriber.feeds, PromptTokens(tokenizers), args.kv_overlap_weight)
    return strategy, subscriber


def memory_sharing(pool: ReplicaPool, kv: KVAware | None, release: Callable[[Replica, str], None]) -> PrefixSharing:
    """--memory-sharing over the KV index (ValueError naming it with fewer than two replicas of a model)."""
    if kv is None or not any(len(pool.of_model(m)) > 1 for m in pool.models):
        raise ValueError("--memory-sharing pulls a prefix's KV from a peer replica: give 2+ --replica of a model")
    return PrefixSharing(pool, kv, release)


async def serve(args: argparse.Namespace) -> int:
    pool = ReplicaPool(args.replica)
    metrics = RouterMetrics()
    wants_index = args.routing_strategy == "kv" or args.memory_sharing  # who holds which prefix
    kv, subscriber = kv_routing(pool, args, metrics) if wants_index else (None, None)
    router = Router(
        pool, args.routing_strategy, args.default_model, args.routing_prefix_chars, args.routing_load_factor, metrics,
        kv if args.routing_strategy == "kv" else None,
    )  # fmt: skip
    links = open_links(pool)
    generation = RouterGeneration(Forwarder(router, links, metrics), args.probe_timeout)
    if args.memory_sharing:
        generation.forwarder.sharing = memory_sharing(pool, kv, generation.forwarder.release)
    if args.disaggregate:
        generation.disaggregator = Disaggregator(generation.forwarder, args.disaggregate_min_prompt_tokens)
    control = RouterControl(generation, args.replica_control_token)
    credentials = server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None
    server, health = build_server(generation, f"{args.host}:{args.port}", credentials, args.control_token, control)
    door = RouterHttp(generation, args.replica_api_key, args.probe_timeout)
    app = build_router_app(door, args.api_key)
    http = OpenAIServer(app, args.host, args.openai_port) if args.openai_port else None  # binds now
    if args.metrics_port:
        metrics.serve(args.metrics_host, args.metrics_port)
    await server.start()
    if http is not None:
        http.start()
    await set_serving(health, False)
    prober = Prober(pool, links, metrics, args.probe_interval, args.probe_timeout, args.replica_control_token)
    generation.forwarder.refresh_adapters = prober.refresh_adapters
    tasks: list[asyncio.Future] = [
        asyncio.ensure_future(prober.run()),
        asyncio.ensure_future(report_health(pool, health, lambda: generation.draining)),
    ]
    if subscriber is not None:
        tasks.append(asyncio.ensure_future(subscriber.run()))
    if args.rebalance:
        token = args.replica_control_token
        rebalancer = Rebalancer(generation.forwarder, args.probe_interval, args.probe_timeout, token)
        tasks.append(asyncio.ensure_future(rebalancer.run()))
    logger.info(
        "routing on %s:%d by %s: %s",
        args.host,
        args.port,
        router.strategy_name,
        ", ".join(f"{r.model}@{r.address}" + (f" x{r.weight:g}" if r.weight != 1 else "") for r in pool.replicas),
    )
    stop, hurry = stop_signals()  # the first signal drains, a second ends the drain
    await stop.wait()
    drain = generation.drain(args.shutdown_timeout or None)
    tasks += [asyncio.ensure_future(drain), asyncio.ensure_future(hurry.wait())]
    await asyncio.wait(tasks[-2:], return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down with %d stream(s) open", len(generation.live))
    for task in tasks:
        task.cancel()
    if http is not None:
        await http.stop()
    await server.stop(grace=1.0)
    await door.close()
    for link in links.values():
        await link.channel.close()
    metrics.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return asyncio.run(serve(args))
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
