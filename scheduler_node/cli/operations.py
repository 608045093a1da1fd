"""The scheduler's operations flags: liveness, overload, draining, metrics, security."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from proto.wire import HEARTBEAT_TIMEOUT_S
from proto.worker_flags import add_curve_flag
from scheduler_node.engine.core import EngineOptions

logger = logging.getLogger(__name__)

TOKEN_ENV = "MINIVLLM_CONTROL_TOKEN"
ENGINE = EngineOptions()  # the flags' defaults are the engine's own


def add_operations_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=HEARTBEAT_TIMEOUT_S,
        help="seconds of silence after which a worker is declared lost (and after which a worker whose "
        "scheduler went silent exits); heartbeats go both ways every quarter of it",
    )
    p.add_argument(
        "--worker-rejoin-timeout",
        type=float,
        default=ENGINE.rejoin_timeout,
        help="seconds to wait for a replacement of a lost worker before failing its requests with UNAVAILABLE",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=ENGINE.step_timeout,
        help="seconds a step may run on the workers, plus 20 ms per token it computes, before the ranks that owe "
        "its answer are declared lost (a hung step; the usual recovery follows)",
    )
    p.add_argument(
        "--shutdown-timeout",
        "--drain-timeout",
        dest="shutdown_timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: new requests are refused at once (UNAVAILABLE / HTTP 503 with Retry-After) while "
        "running ones get this many seconds to finish; then those left end with UNAVAILABLE ('the server is "
        "shutting down') and the process exits 0 (0: no limit; a second signal ends them at once). The same "
        "drain as Control.Drain; --drain-timeout is its former name",
    )
    p.add_argument(
        "--exit-after-drain",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="exit 0 once a Control.Drain answers 'drained' (nothing left running), as after SIGTERM: the "
        "replica of a rolling restart, which vllm-serve starts again (vllm-serve --data-parallel-size turns it on "
        "for its replicas)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=ENGINE.max_waiting_requests,
        help="waiting sequences at most; beyond it new requests get RESOURCE_EXHAUSTED at once (0: unbounded)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="port of the Prometheus /metrics endpoint (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of the Prometheus endpoint")
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help="publish the prefix cache's block stored/removed events (ZeroMQ PUB, msgpack) on this port for "
        "vllm-router --routing-strategy kv (0: off)",
    )
    p.add_argument(
        "--kv-events-snapshot-port",
        type=int,
        default=0,
        help="port where a late or resynchronizing subscriber asks for every cached block hash (0: "
        "--kv-events-port + 1)",
    )
    p.add_argument(
        "--kv-events-host",
        default="127.0.0.1",
        help="bind address of the KV events sockets (they reveal which prompts were seen: open only to the router)",
    )
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve gRPC over TLS with this certificate chain")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument(
        "--control-token",
        default=os.environ.get(TOKEN_ENV, ""),
        help="Control RPCs need metadata 'authorization: Bearer TOKEN', and the HTTP control routes (POST "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter) the header 'Authorization: Bearer TOKEN', not the API key "
        f"(default: ${TOKEN_ENV}; empty: Control is open, the HTTP routes behind --api-key like every route)",
    )
    add_curve_flag(p)


def check_operations_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag that is out of range."""
    for name in ("heartbeat_timeout", "worker_rejoin_timeout", "step_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.shutdown_timeout < 0 or args.max_waiting_requests < 0:
        raise ValueError("--shutdown-timeout and --max-waiting-requests must be >= 0")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for name in ("kv_events_port", "kv_events_snapshot_port"):
        if not 0 <= getattr(args, name) < 65536:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got {getattr(args, name)}")


def stop_signals() -> tuple[asyncio.Event, asyncio.Event]:
    """(stop, hurry) on the running loop: the first SIGINT/SIGTERM sets `stop` (drain), a second `hurry` (end it)."""
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return stop, hurry
