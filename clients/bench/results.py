"""One load run's figures: throughput, latency distributions (TTFT, TPOT, ITL, end to end) and goodput under SLOs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from clients.bench.backends import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")  # vLLM's names; goodput SLOs take the same keys (except itl)
SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def tpot(r: RequestResult) -> float | None:
    """Time per output token after the first; None for a request with one token."""
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """`ttft:500 tpot:50` (milliseconds) → {"ttft": 0.5, "tpot": 0.05} in seconds."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput {item}: the key must be one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item}: expected KEY:MILLISECONDS") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item}: the limit must be > 0 ms")
        slos[key] = ms / 1000
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return r.ok and all(values[key] <= limit for key, limit in slos.items())


@dataclass
class RunSummary:
    request_rate: float
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input + output tokens per second
    goodput: float | None  # requests per second that met every SLO (None: no SLO given)
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # ttft/tpot/itl/e2el -> mean, p50, ...
    errors: list[str] = field(default_factory=list)  # the first few


def summarize(rate: float, results: list[RequestResult], duration: float, slos: dict[str, float]) -> RunSummary:
    done = [r for r in results if r.ok]
    inputs, outputs = sum(r.prompt_len for r in done), sum(r.output_len for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := tpot(r)) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    latency = {
        name: {
            "mean": 1000 * sum(values) / len(values) if values else math.nan,
            **{f"p{q}": 1000 * percentile(values, q) for q in PERCENTILES},
        }
        for name, values in samples.items()
    }
    per_s = 1 / duration if duration > 0 else math.nan
    return RunSummary(
        request_rate=rate,
        duration_s=duration,
        completed=len(done),
        failed=len(results) - len(done),
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        request_throughput=len(done) * per_s,
        output_throughput=outputs * per_s,
        total_token_throughput=(inputs + outputs) * per_s,
        goodput=sum(meets(r, slos) for r in done) * per_s if slos else None,
        latency_ms=latency,
        errors=[r.error for r in results if not r.ok][:5],
    )
