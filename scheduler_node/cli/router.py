"""vllm-router: one gRPC address (and with --openai-port one OpenAI API) in front of several schedulers (replicas
of one model, or different models)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from proto.cli_config import add_config_flag, parse_args
from scheduler_node.api.grpc_server import build_server
from scheduler_node.api.health import set_serving
from scheduler_node.api.openai_server import OpenAIServer
from scheduler_node.api.security import server_credentials
from scheduler_node.cli.openai_flags import API_KEY_ENV, add_api_key_flag
from scheduler_node.cli.operations import TOKEN_ENV, stop_signals
from scheduler_node.router.control import RouterControl
from scheduler_node.router.disaggregate import DEFAULT_MIN_PROMPT_TOKENS, Disaggregator
from scheduler_node.router.grpc_door import RouterGeneration
from scheduler_node.router.http_door import RouterHttp, build_router_app
from scheduler_node.router.kv_index import KVIndex
from scheduler_node.router.kv_strategy import DEFAULT_OVERLAP_WEIGHT, KVAware, PromptTokens
from scheduler_node.router.kv_subscriber import KVSubscriber
from scheduler_node.router.metrics import RouterMetrics
from scheduler_node.router.probe import Prober, report_health
from scheduler_node.router.rebalance import Rebalancer
from scheduler_node.router.replica import ReplicaPool, ReplicaSpec, parse_replica
from scheduler_node.router.routing import Router
from scheduler_node.router.strategies import DEFAULT_LOAD_FACTOR, STRATEGIES
from scheduler_node.router.upstream import Forwarder, open_links
from scheduler_node.text.tokenizer import ModelTokenizer

logger = logging.getLogger("vllm-router")


def replica_flag(value: str | dict) -> ReplicaSpec:
    """--replica's type: argparse shows an ArgumentTypeError's words (a ValueError's it hides)."""
    try:
        return parse_replica(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    """How requests are spread over the replicas (shared with vllm-serve --data-parallel-size)."""
    p.add_argument(
        "--routing-strategy",
        default="least_loaded",
        help=f"{', '.join(STRATEGIES)}, or module:function for your own (see scheduler_node/router/routing.py "
        "and deploy/custom_route.py)",
    )
    p.add_argument(
        "--routing-prefix-chars",
        type=int,
        default=256,
        help="prefix: characters of the prompt (a quarter as many token ids) whose hash picks the replica; keep "
        "it shorter than the prompts' shared part (the system prompt)",
    )
    p.add_argument(
        "--routing-load-factor",
        type=float,
        default=DEFAULT_LOAD_FACTOR,
        help="prefix: a replica takes a request only while its open streams stay within this multiple of its "
        "weighted share of all open streams; else the ring's next replica does",
    )
    p.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=DEFAULT_OVERLAP_WEIGHT,
        help="kv: what a prompt block a replica would compute costs against a block of work it has (cost = weight x "
        "uncached blocks + prompt blocks it has yet to compute + blocks its requests hold); higher follows the "
        "cache harder, 0 ignores it",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-router",
        description="Route minivllm.v1.Generation requests (and with --openai-port OpenAI API requests) over "
        "several vllm-scheduler replicas by the request's model and a strategy, with health checks and one retry "
        "before the first token.",
    )
    add_config_flag(p)
    p.add_argument(
        "--disaggregate",
        action="store_true",
        help="compute each gRPC request's prompt on a replica with kv_role=prefill (or both) and generate on one "
        "with kv_role=decode (or both), which pulls the prompt's KV from the first (vllm-serve --kv-role)",
    )
    p.add_argument(
        "--disaggregate-min-prompt-tokens",
        type=int,
        default=DEFAULT_MIN_PROMPT_TOKENS,
        metavar="N",
        help="with --disaggregate, a prompt shorter than N tokens skips the prefill replica and is computed where it "
        "decodes (too few blocks to be worth moving; 0: every prompt is moved). Counted without a tokenizer: token "
        "ids exactly, text (a chat's message contents) as its characters / 4",
    )
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    p.add_argument("--port", type=int, default=50050, help="gRPC port")
    p.add_argument(
        "--replica",
        type=replica_flag,
        action="append",
        default=[],
        metavar="HOST:PORT,model=NAME[,weight=W][,http=HOST:PORT][,kv_events=HOST:PORT][,tokenizer=DIR]",
        help="a scheduler to route to (its gRPC address), the model name it serves (its --served-model-name), its "
        "weight (default 1), its OpenAI API (its --openai-port, for the router's --openai-port), and for "
        "--routing-strategy kv its KV events (its --kv-events-port; kv_snapshot=HOST:PORT when not that port + 1) "
        "and the model's folder (to tokenize text like it); repeatable. In a config file: a list of {address, "
        "model, weight, http, kv_events, kv_snapshot, tokenizer}",
    )
    p.add_argument(
        "--openai-port",
        type=int,
        default=0,
        help="port of the OpenAI-compatible HTTP API on --host, forwarded to the replicas' own (http= in "
        "--replica; 0: off)",
    )
    add_api_key_flag(p)
    p.add_argument(
        "--replica-api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"the replicas' --api-key, sent with every HTTP request forwarded to them (default: ${API_KEY_ENV})",
    )
    p.add_argument("--default-model", default="", help="the model of requests that name none (default: the first)")
    add_routing_flags(p)
    p.add_argument(
        "--probe-interval",
        type=float,
        default=0.5,
        help="seconds between two health checks (and GetStats) of each replica",
    )
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=1.0,
        help="seconds a replica has to answer a health check, GetStats or Abort before it counts as down",
    )
    p.add_argument(
        "--rebalance",
        action="store_true",
        help="move a replica's longest-running gRPC stream to another replica (live migration) while its queue is "
        "long and another replica of its model is idle (needs the replicas' Control: --replica-control-token)",
    )
    p.add_argument(
        "--replica-control-token",
        default=os.environ.get(TOKEN_ENV, ""),
        help=f"the replicas' --control-token, for GetStats (default: ${TOKEN_ENV})",
    )
    p.add_argument(
        "--control-token",
        default=os.environ.get(TOKEN_ENV, ""),
        help=f"the router's Control RPCs need metadata 'authorization: Bearer TOKEN' (default: ${TOKEN_ENV}; "
        "empty: open)",
    )
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve gRPC over TLS with this certificate chain")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--metrics-port", type=int, default=0, help="port of the Prometheus /metrics endpoint (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of the Prometheus endpoint")
    p.add_argument(
        "--shutdown-timeout",
        "--drain-timeout",
        dest="shutdown_timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds to let open streams finish while new ones are refused (0: no limit; a "
        "second signal stops at once); --drain-timeout is its former name",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    return p


def check_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag that is out of range."""
    for name in ("probe_interval", "probe_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if not 0 <= args.openai_port < 65536:
        raise ValueError(f"--openai-port must be in [0, 65535], got {args.openai_port}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")


def kv_routing(pool: ReplicaPool, args: argparse.Namespace, metrics: RouterMetrics) -> tuple[KVAware, KVSubscriber]:
    """The `kv` strategy over an index fed by the replicas' KV events (ValueError when none publishes them)."""
    if not any(r.spec.kv_events for r in pool.replicas):
        raise ValueError("--routing-strategy kv: no --replica has kv_events=HOST:PORT (its --kv-events-port)")
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


async def serve(args: argparse.Namespace) -> int:
    check_flags(args)
    pool = ReplicaPool(args.replica)
    metrics = RouterMetrics()
    kv, subscriber = kv_routing(pool, args, metrics) if args.routing_strategy == "kv" else (None, None)
    router = Router(
        pool, args.routing_strategy, args.default_model, args.routing_prefix_chars, args.routing_load_factor, metrics,
        kv,
    )  # fmt: skip
    links = open_links(pool)
    generation = RouterGeneration(Forwarder(router, links, metrics), args.probe_timeout)
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
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.disaggregate_min_prompt_tokens < 0:
        parser.error(f"--disaggregate-min-prompt-tokens: {args.disaggregate_min_prompt_tokens} is negative")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return asyncio.run(serve(args))
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
