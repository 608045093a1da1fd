"""The engine's metrics (scheduler_node/engine/metrics.py) without a server: what a scrape of them reads."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proto.drop_log import DropLog
from scheduler_node.engine.metrics import ITL_BUCKETS, LoopHistogram, Metrics

pytestmark = pytest.mark.unit
LOGGER = logging.getLogger(__name__)


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


def test_speculative_decoding_counters_reach_prometheus_and_get_stats() -> None:
    """vLLM's names: drafts, draft tokens, accepted tokens and accepted per position, in the exposition and in
    GetStats' snapshot (stand-in workers accept a random number of each proposal)."""
    import asyncio

    from scheduler_node.core.config import SchedulerConfig
    from scheduler_node.core.stats import snapshot
    from settings.speculative import SpeculativeConfig
    from tests.support.stand_in import StandInRun, spec

    async def scenario() -> tuple[str, object]:
        config = SchedulerConfig(block_size=8, speculative=SpeculativeConfig(num_speculative_tokens=3))
        run = StandInRun.build(config, 64)
        run.engine.metrics.bind(run.engine.live_metrics, asyncio.get_running_loop())
        run.start()
        run.submit(spec("r", 8, 40))
        await run.until_idle()
        await run.stop()
        return generate_latest(run.engine.metrics.registry).decode(), snapshot(run.engine.scheduler)

    text, stats = asyncio.run(scenario())
    samples = {
        (s.name, s.labels.get("position", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    drafts = samples[("vllm:spec_decode_num_drafts_total", "")]
    proposed = samples[("vllm:spec_decode_num_draft_tokens_total", "")]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", "")]
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)]
    assert 0 < accepted < proposed <= 3 * drafts and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # position i is accepted only after i - 1
    assert stats.spec_decode_num_drafts == drafts and stats.spec_decode_num_accepted_tokens_per_pos == per_pos  # type: ignore[attr-defined]


def test_dropped_messages_are_one_counter_series_per_socket() -> None:
    """minivllm:dropped_messages: the DropLogs of one socket add up (a scheduler has one of each; a test may make
    two), each socket its own series, under the exporter's model label."""
    logs = [DropLog("workers", LOGGER) for _ in range(2)] + [DropLog("kv_snapshots", LOGGER)]
    for log, n in zip(logs, (3, 4, 5), strict=True):
        for _ in range(n):
            log.drop("junk")
    metrics = Metrics("m")
    metrics.count_drops(*logs[:2])
    metrics.count_drops(logs[2])
    (family,) = (f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                 if f.name == "minivllm:dropped_messages")  # fmt: skip
    assert {(s.labels["model_name"], s.labels["socket"]): s.value for s in family.samples} == {
        ("m", "workers"): 7.0,
        ("m", "kv_snapshots"): 5.0,
    }
