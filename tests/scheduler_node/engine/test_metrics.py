"""The engine's metrics (scheduler_node/engine/metrics.py) without a server: what a scrape of them reads."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_node.engine.metrics import ITL_BUCKETS, LoopHistogram

pytestmark = pytest.mark.unit


def test_loop_histogram_exposes_what_prometheus_client_does() -> None:
    """The ITL histogram counts without a lock; a scrape must read the same series as a locked Histogram's."""
    values = [0.0, 0.001, 0.0011, 0.05, 0.3, 0.3, 79.0, 80.0, 81.0, 1e9]  # on bounds, between them, past the last
    registry = CollectorRegistry()
    ours = LoopHistogram("ours", "doc", ITL_BUCKETS, "m")
    registry.register(ours)
    theirs = Histogram("theirs", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=registry).labels("m")
    for v in values:
        ours.observe(v)
        theirs.observe(v)
    series: dict[str, dict[tuple[str, str], float]] = {"ours": {}, "theirs": {}}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            who, suffix = s.name.split("_", 1)
            if suffix != "created":
                series[who][(suffix, s.labels.get("le", ""))] = s.value
    assert series["ours"] == series["theirs"] and len(series["ours"]) == len(ITL_BUCKETS) + 3  # +Inf, count, sum
