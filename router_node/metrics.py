"""The router's Prometheus metrics (`vllm-router --metrics-port`): requests per replica, routing decisions per
strategy, retries, request errors by status, each replica's health and open streams, and (kv strategy) the blocks
its KV index holds per replica."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector

from scheduler_node.engine.metrics import Exporter


class RouterMetrics(Exporter):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "minivllm:router_requests", "Streams opened on each replica (a retry counts on its own replica)",
            ["model", "replica"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "minivllm:router_decisions", "Routing decisions by strategy and outcome (prefix: affinity or overflow)",
            ["strategy", "decision"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "minivllm:router_retries", "Requests sent again to another replica after UNAVAILABLE before any token",
            ["model"], registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "minivllm:router_request_errors", "Requests that ended with a status other than OK, by status",
            ["model", "code"], registry=r,
        )  # fmt: skip
        self.healthy = Gauge(
            "minivllm:router_replica_healthy", "1 while the replica is serving, else 0", ["model", "replica"],
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "minivllm:router_replica_in_flight", "Streams the router has open on the replica", ["model", "replica"],
            registry=r,
        )  # fmt: skip
        self.kv_blocks = Gauge(
            "minivllm:router_kv_indexed_blocks", "kv strategy: block hashes the router's index holds for the replica "
            "(0 while it resynchronizes)", ["model", "replica"], registry=r,
        )  # fmt: skip
        ProcessCollector(registry=r)

    def decided(self, strategy: str, decision: str) -> None:
        self.decisions.labels(strategy, decision).inc()
