"""vllm-monitor's short names (the design article's `--metric memory_usage`, `cache_hit_rate`, `fragmentation`): each
stands for series the engine exports, --help lists them, they print those series from a real exposition (the
engine's own exporter over stand-in workers, mid-run), and a name the server lacks exits 2 naming the valid ones."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from clients import monitor
from scheduler_node.core.config import SchedulerConfig
from scheduler_node.engine.metrics import COUNTERS, GAUGES, LABELLED_COUNTERS, LABELLED_GAUGES
from settings.config_file import parse_args
from tests.seeds.blocks import block
from tests.support.stand_in import StandInRun, spec

pytestmark = pytest.mark.unit

URL = "http://127.0.0.1:9090/metrics"


@pytest.fixture(scope="module")
def exposition() -> str:
    """A scrape of the engine's registry while two requests run (13 and 21 tokens in blocks of 8: partly filled
    last blocks, so fragmentation is above 0)."""

    async def scenario() -> str:
        run = StandInRun.build(SchedulerConfig(block_size=8), 64)
        run.engine.metrics.bind(run.engine.live_metrics, asyncio.get_running_loop())
        run.start()
        run.submit(spec("a", 13, 30))
        run.submit(spec("b", 21, 30, first=500))
        for _ in range(10_000):
            await asyncio.sleep(0)
            if run.engine.scheduler.running and run.engine.scheduler.blocks.num_used:
                break
        text = generate_latest(run.engine.metrics.registry).decode()
        await run.until_idle()
        await run.stop()
        return text

    return asyncio.run(scenario())


def run_monitor(text: str, metrics: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(monitor, "scrape", lambda url, timeout=5.0: text)
    argv = ["--url", URL, "--count", "1"]
    for name in metrics:
        argv += ["--metric", name]
    return monitor.main(argv)


def test_every_short_name_stands_for_series_the_engine_exports() -> None:
    exported = {*GAUGES, *LABELLED_GAUGES, *COUNTERS, *LABELLED_COUNTERS}
    assert {"memory_usage", "cache_hit_rate", "fragmentation"} <= monitor.ALIASES.keys()
    for name, series in monitor.ALIASES.items():
        assert set(series) <= exported, f"{name}: {set(series) - exported} is not exported"
    assert monitor.ALIASES["fragmentation"] == ["minivllm:kv_fragmentation"]


def test_help_lists_the_short_names_and_their_series() -> None:
    text = monitor.build_parser().format_help()
    for name, series in monitor.ALIASES.items():
        line = next((line for line in text.splitlines() if line.split()[:1] == [name]), None)
        assert line is not None and all(s in line for s in series), f"{name} is not listed: {text}"


def test_the_article_short_names_print_their_series(
    exposition: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_monitor(exposition, ["memory_usage", "cache_hit_rate", "fragmentation"], monkeypatch) == 0
    lines = capsys.readouterr().out.splitlines()
    values = {line.split()[1]: float(line.split()[2]) for line in lines}
    fragmentation = [line for line in lines if line.split()[1].startswith("minivllm:kv_fragmentation{")]
    assert len(fragmentation) == 1, lines  # printed once, though two of the names ask for it
    assert 0 < values[fragmentation[0].split()[1]] < 1, lines
    assert any(k.startswith("vllm:kv_cache_usage_perc{") and v > 0 for k, v in values.items()), lines
    for series in ("minivllm:kv_cache_used_bytes{", "minivllm:kv_cache_allocated_bytes{"):
        assert any(k.startswith(series) and 'tier="device"' in k for k in values), lines
    assert any(k.startswith("minivllm:cache_hit_rate{") and 'tier="device"' in k for k in values), lines


def test_a_long_name_still_works(
    exposition: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_monitor(exposition, ["minivllm:kv_fragmentation", "vllm:prefix_cache_hits_total"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "minivllm:kv_fragmentation{" in out and "vllm:prefix_cache_hits_total{" in out


def test_an_unknown_name_exits_2_listing_the_valid_ones(
    exposition: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_monitor(exposition, ["memory_usag"], monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"no metric memory_usag at {URL}" in err
    assert "did you mean memory_usage" in err
    assert "short names: cache_hit_rate, memory_usage, fragmentation, spec_decode" in err
    assert "minivllm:kv_fragmentation" in err and "vllm:num_requests_running" in err  # the server's series


def test_the_articles_lines_run_as_written(
    exposition: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vllm-monitor --metric memory_usage --interval 1` and `vllm-monitor --metric cache_hit_rate` (article 003)."""
    monkeypatch.setattr(monitor, "scrape", lambda url, timeout=5.0: exposition)
    slept: list[float] = []
    monkeypatch.setattr(monitor.time, "sleep", slept.append)
    memory = block("monitor_memory").text.split()[1:]  # the command's arguments as the article writes them
    assert monitor.main([*memory, "--url", URL, "--count", "2"]) == 0
    assert slept == [1.0]
    assert "vllm:kv_cache_usage_perc{" in capsys.readouterr().out
    assert monitor.main([*block("monitor_hit_rate").text.split()[1:], "--url", URL, "--count", "1"]) == 0
    assert "minivllm:cache_hit_rate{" in capsys.readouterr().out


def test_the_interval_takes_a_unit_and_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(monitor.build_parser(), ["--metric", "fragmentation", "--interval", "500ms"]).interval == 0.5
    with pytest.raises(SystemExit):
        parse_args(monitor.build_parser(), ["--metric", "fragmentation", "--interval", "0"])
    assert "--interval must be > 0, got 0.0" in capsys.readouterr().err
