"""Prometheus metrics (`--metrics-port`) under vLLM's names, so existing dashboards work, plus minivllm's own.

Counters and histograms are updated as things happen (those of tokens and finished requests by the output thread,
engine/output_thread.py). Gauges (queues, KV usage, fragmentation) and the scheduler's counters (preemptions, prefix
cache) are read at scrape time, on the event loop's thread, so the scrape never sees the scheduler half-way through
a change.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from proto.drop_log import DropLog

# A scrape's live values: name -> value, or (for LABELLED_GAUGES) name -> label values -> value
LiveSample = dict[str, float | dict[tuple[str, ...], float]]
LiveValues = Callable[[], LiveSample]  # the gauges and scheduler counters, read on the event loop's thread

logger = logging.getLogger(__name__)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Exporter:
    """A registry served at `/metrics` over HTTP (`--metrics-port`) until `close`."""

    registry: CollectorRegistry
    _server: Any = None
    _drops: DropCounts | None = None

    def count_drops(self, *logs: DropLog) -> None:
        """Export what these sockets dropped (proto/drop_log.py) as minivllm:dropped_messages, by socket."""
        if self._drops is None:
            self._drops = DropCounts(self.fixed_labels())
            self.registry.register(self._drops)
        self._drops.logs.extend(logs)

    def fixed_labels(self) -> dict[str, str]:
        """Labels every series of this exporter's own collectors carries (beside their own)."""
        return {}

    def serve(self, host: str, port: int) -> None:
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class Metrics(Exporter):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        counter, histogram = self._counter, self._histogram
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests that started")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self._success = Counter(
            "vllm:request_success",
            "Finished sequences, by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS)
        # Observed for every token of every sequence: counts under the GIL, not prometheus_client's locked values.
        self.itl = LoopHistogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens of a sequence", ITL_BUCKETS, model_name
        )
        self.registry.register(self.itl)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled", REQUEST_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step", TOKEN_BUCKETS)
        self.schedule_time = histogram("minivllm:scheduler_step_seconds", "Scheduler.schedule() per step", STEP_BUCKETS)
        self.step_time = histogram(
            "minivllm:engine_step_seconds", "One engine step: schedule, run on the workers, stream out", STEP_BUCKETS
        )
        self.worker_losses = counter("minivllm:worker_losses", "Times a rank was lost (died or stalled)")
        self.batch_utilization = 0.0  # tokens of the last step / max_num_batched_tokens
        self.read: LiveValues | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.registry.register(_LiveCollector(self))
        ProcessCollector(registry=self.registry)  # process_open_fds, process_resident_memory_bytes, ...

    def fixed_labels(self) -> dict[str, str]:
        return {"model_name": self.model_name}

    def _counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

    def finished(self, reason: str, e2e_s: float | None) -> None:
        self._success.labels(self.model_name, reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def bind(self, read: LiveValues, loop: asyncio.AbstractEventLoop) -> None:
        """Read the live gauges with `read`, on this loop's thread."""
        self.read, self.loop = read, loop

    def live(self) -> LiveSample:
        """The scrape-time values, computed on the event loop's thread ({} while the workers are joining)."""
        loop, read = self.loop, self.read
        if loop is None or read is None or loop.is_closed():
            return {}
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return read()
        if threading.current_thread() is threading.main_thread():
            return {}  # no loop thread to ask
        try:
            return asyncio.run_coroutine_threadsafe(_call(read), loop).result(timeout=5)
        except Exception as exc:  # a busy or stopping loop: the scrape goes on without these
            logger.warning("metrics: live values unavailable: %s", exc)
            return {}


GAUGES = {
    "vllm:num_requests_running": "Requests running on the workers",
    "vllm:num_requests_waiting": "Requests waiting (new and preempted)",
    "vllm:kv_cache_usage_perc": "Fraction of usable KV blocks in use (1 = full)",
    "minivllm:kv_fragmentation": "Internal fragmentation of the KV cache: 1 - tokens stored / slots held",
    "minivllm:batch_utilization": "Tokens in the last step / max_num_batched_tokens",
    "minivllm:workers_ready": "Ranks ready",
    "minivllm:asyncio_tasks": "Tasks alive on the scheduler's event loop",
    "minivllm:kv_tier_ram_blocks_used": "KV blocks held by the host-RAM offload tier",
    "minivllm:kv_tier_disk_blocks_used": "KV blocks held by the disk offload tier",
    "minivllm:kv_tier_mean_move_ms": "Mean time per step the workers spent moving KV tier blocks",
}
LABELLED_GAUGES = {  # name -> (help, label names beside model_name)
    "minivllm:kv_cache_allocated_bytes": (
        "KV bytes the workers hold (all ranks), by tier and format",
        ("tier", "format"),
    ),
    "minivllm:kv_cache_used_bytes": ("KV bytes in use (all ranks), by tier and format", ("tier", "format")),
    "minivllm:cache_hit_rate": ("Prompt tokens found in a tier's prefix cache / prompt tokens looked up", ("tier",)),
    "minivllm:lora_requests": (
        "Requests with a LoRA adapter, by adapter and state (running, waiting)",
        ("adapter", "state"),
    ),  # fmt: skip
    "minivllm:lora_memory_bytes": ("LoRA adapters' bytes (as their files store them), by tier", ("tier",)),
    "minivllm:lora_adapters_resident": ("LoRA adapters held, by tier (device slots, host memory)", ("tier",)),
}
COUNTERS = {
    "vllm:num_preemptions": "Preemptions (recompute and swap; a lost worker preempts every running request)",
    "vllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "vllm:prefix_cache_hits": "Prompt tokens found in the prefix cache",
    "minivllm:migrations_imported": "Sequences migrated here from another replica that resumed from its KV",
    "minivllm:migrations_recomputed": "Sequences migrated here from another replica that recomputed their tokens",
    "minivllm:migration_kv_tokens_imported": "KV positions of migrated sequences pulled from their source replica",
    "minivllm:kv_tier_ram_hits": "KV blocks loaded back from the host-RAM offload tier instead of recomputed",
    "minivllm:kv_tier_disk_hits": "KV blocks loaded back from the disk offload tier instead of recomputed",
    "minivllm:kv_tier_failed_loads": "KV tier blocks that failed their check when loaded and were recomputed",
    "minivllm:kv_tier_failed_stores": "KV blocks a worker could not write to its disk tier (dropped; disk tier off)",
    "minivllm:kv_tier_bytes_moved": "Bytes of KV (one rank's shards) moved between the device and the offload tiers",
    "vllm:spec_decode_num_drafts": "Speculated steps of a request (speculative decoding)",
    "vllm:spec_decode_num_draft_tokens": "Tokens proposed (speculative decoding)",
    "vllm:spec_decode_num_accepted_tokens": "Proposed tokens accepted (speculative decoding)",
}
LABELLED_COUNTERS = {  # name -> (help, label names beside model_name)
    "vllm:spec_decode_num_accepted_tokens_per_pos": (
        "Proposed tokens accepted at each position of a proposal (speculative decoding)",
        ("position",),
    ),
}


class LoopHistogram(Collector):
    """A histogram written by one thread only (the output thread), read by scrapes as prometheus_client's are: one
    bisect and two additions per observation, about a fifth of a locked Histogram's cost."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # bucket i holds values <= bounds[i]
        self.sum += value

    def observe_n(self, value: float, n: int) -> None:
        """`n` observations of `value`."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self.counts), self.sum  # a copy: the loop goes on writing
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative = list(itertools.accumulate(counts))
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family.add_metric([self.model_name], buckets, total)
        yield family


class DropCounts(Collector):
    """minivllm:dropped_messages: the messages each socket's DropLog counted, read at scrape time (a plain int per
    socket, so the socket's thread pays nothing for the metric)."""

    NAME = "minivllm:dropped_messages"
    DOC = "Messages a socket dropped: malformed, oversized, unexpected from their sender, or refused"

    def __init__(self, fixed: dict[str, str]) -> None:
        self.fixed = fixed
        self.logs: list[DropLog] = []

    def collect(self) -> Iterator[Metric]:
        totals: dict[str, int] = {}
        for log in self.logs:  # two logs of one socket (a test's two links) add up: one series per socket
            totals[log.socket] = totals.get(log.socket, 0) + log.total
        family = CounterMetricFamily(self.NAME, self.DOC, labels=[*self.fixed, "socket"])
        for socket, total in sorted(totals.items()):
            family.add_metric([*self.fixed.values(), socket], total)
        yield family


async def _call(read: LiveValues) -> LiveSample:
    return read()


class _LiveCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        values = self.metrics.live()
        name = self.metrics.model_name
        for key, doc in GAUGES.items():
            gauge = GaugeMetricFamily(key, doc, labels=["model_name"])
            value = values.get(key)
            if isinstance(value, (int, float)):
                gauge.add_metric([name], value)
            yield gauge
        for key, (doc, labels) in LABELLED_GAUGES.items():
            gauge = GaugeMetricFamily(key, doc, labels=["model_name", *labels])
            series = values.get(key)
            if isinstance(series, dict):
                for label_values, value in series.items():
                    gauge.add_metric([name, *label_values], value)
            yield gauge
        for key, doc in COUNTERS.items():
            counter = CounterMetricFamily(key, doc, labels=["model_name"])
            value = values.get(key)
            if isinstance(value, (int, float)):
                counter.add_metric([name], value)
            yield counter
        for key, (doc, labels) in LABELLED_COUNTERS.items():
            counter = CounterMetricFamily(key, doc, labels=["model_name", *labels])
            series = values.get(key)
            if isinstance(series, dict):
                for label_values, value in series.items():
                    counter.add_metric([name, *label_values], value)
            yield counter
